"""The last phase of `fivefold calibrate` on a CPU: one whole training step of a reference model, timed through the
engine, against what the profile's parts (matmuls, attention, loss, element-wise operators, fixed costs,
optimizer) predict for it. Each part is timed alone on operands that stream from memory, between nothing else; a
real step also pays for autograd's bookkeeping, the modules' Python and the caches that one operator leaves to
the next. The reference model's own parts (its linear shapes, attention, loss, element-wise operators, fixed costs and
optimizer) are timed again just before and just after the step (the median of 30 steps after 5), as the full
tables time them, so that the step and its parts see the machine at the same moment: on a shared machine whose
speed moves by a fifth from minute to minute, the step set against the tables measured a minute earlier made the
factor a reading of the machine's speed then (0.81 to 1.38 in four calibrations of one afternoon) rather than of
what a step adds to its parts. The ratio, measured over steps / predicted from those parts, becomes the profile's
`compute_scale`, which multiplies every compute time the planner reads from the profile (communication is
measured as it runs and is not scaled).

Then the same step under selective recompute, in rounds alternating with the plain step (`time_recompute_pair`):
what it takes beyond the plain step, less what the planner charges for the work the policy reruns (the
element-wise operators and their fixed costs, at that scale), per block, is the profile's `selective_dispatch_us`:
the host time of the checkpoint's per-operator policy (a dispatch mode over every operator of the block, in the
forward and again in the recomputation), which on a CPU costs more than the block's own work at small sizes.

Last, the resident memory of the same step in a fresh process (`fivefold bench`, which measures a run's peak resident
set above the process's baseline as the sweep does) against the live tensors the planner counts for it: the
profile's `heap_retention`. glibc keeps in its heap what a step frees (it returns only the heap's top, and its mmap
threshold rises to the largest chunk freed, so that nearly every tensor of a small model lands in the heap), so a
CPU run holds more than its tensors: 1.5-2.3x on one process and dp2 in the sweep of `examples/sweep-cpu.toml`.
A fresh process, because the calibrating one has freed the tables' operands into its own heap, which the step
would reuse.

The reference model is none of the presets: 2 layers, hidden 128, 4 heads (head dim 32) with as many key/value
heads, MLP 256, vocabulary 1024, 128 tokens per sequence, 4 sequences per step, fp32."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

REFERENCE = {"model.name": "calibrate-reference", "model.n_layers": "2", "model.hidden": "128",
             "model.n_heads": "4", "model.n_kv_heads": "4", "model.ffn": "256", "model.vocab_size": "1024",
             "model.max_seq_len": "128", "train.seq_len": "128", "train.global_batch_size": "4",
             "layout.micro_batch_size": "4", "train.device": "cpu", "train.dtype": "fp32", "train.warmup_steps": "0"}
# a heap retention beyond this is not the allocator's cache but something else holding memory (or a broken baseline)
HEAP_RETENTION_MAX = 8.0
# the ratio is bounded: a profile whose parts are off by more than this describes another machine, or the
# step was timed while something else ran
SCALE_BOUNDS = (0.5, 3.0)


def reference_config(threads: int, steps: int, recompute: str = "none"):
    """The reference run's `Config` (one process, `threads` intra-op threads, `recompute` mode)."""
    from fivefold.config import build_config

    cfg = build_config(None, {**REFERENCE, "train.threads": str(threads), "train.max_steps": str(steps),
                              "layout.recompute": recompute})
    cfg.validate()
    return cfg


def time_whole_step(threads: int, steps: int, warmup: int, say: Callable[[str], None]) -> float:
    """Median seconds of the reference model's training step (forward, backward, optimizer) on this CPU, timed as
    `fivefold bench` times one (`tools.bench.run_bench`)."""
    from fivefold.tools.bench import run_bench

    cfg = reference_config(threads, steps + warmup)
    before = torch.get_num_threads()
    try:
        args = argparse.Namespace(micro_batch=cfg.layout.micro_batch_size, grad_accum=1, steps=steps, warmup=warmup,
                                  profile=0, trace=None)
        median = run_bench(args, cfg)["step_time_s"]
    finally:
        torch.set_num_threads(before)  # run_bench sets the reference's
    say(f"whole step of the reference model: {1e3 * median:.1f} ms (median of {steps})")
    return median


def time_recompute_pair(threads: int, rounds: int, steps: int, warmup: int,
                        say: Callable[[str], None]) -> tuple[float, float]:
    """The reference model's training step without and with selective recompute, on the same tokens, timed in
    alternating rounds of `steps` steps (each step on its own, as `fivefold bench` times one): the median plain step
    and the plain step plus the median of the rounds' differences, so that both sides of each difference see the
    machine at the same moment."""
    import statistics
    import time

    from fivefold.train.build import build_engine

    device = torch.device("cpu")
    before = torch.get_num_threads()
    try:
        cfgs = {mode: reference_config(threads, 1, mode) for mode in ("none", "selective")}
        torch.set_num_threads(threads)
        engines = {mode: build_engine(cfg, device) for mode, cfg in cfgs.items()}
        cfg = cfgs["none"]
        gen = torch.Generator().manual_seed(cfg.train.seed)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.layout.micro_batch_size, cfg.train.seq_len + 1),
                               generator=gen)
        micro = [(tokens[:, :-1], tokens[:, 1:])]
        global_tokens = cfg.train.global_batch_size * cfg.train.seq_len

        def step(engine) -> float:
            start = time.perf_counter()
            engine.forward_backward(micro, global_tokens)
            engine.optimizer_step()
            return time.perf_counter() - start

        for engine in engines.values():
            for _ in range(warmup):
                step(engine)
        plain, differences = [], []
        for _ in range(rounds):
            medians = {mode: statistics.median(step(engine) for _ in range(steps)) for mode, engine in engines.items()}
            plain.append(medians["none"])
            differences.append(medians["selective"] - medians["none"])
    finally:
        torch.set_num_threads(before)
    base, extra = statistics.median(plain), statistics.median(differences)
    say(f"the reference step without and with selective recompute, {rounds} alternating rounds of {steps}: "
        f"{1e3 * base:.1f} and {1e3 * (base + extra):.1f} ms")
    return base, base + extra


def predicted_step(cluster, threads: int, recompute: str = "none") -> float:
    """The planner's step time of the reference run on `cluster` (a profile without a whole-step scale)."""
    from fivefold.planner.predict import estimate_run

    return estimate_run(reference_config(threads, 1, recompute), cluster, "cpu").step_time_s


def reference_plan(plan):
    """`plan` (one rank's) cut to the reference model's own parts, measured once and quietly: its linear shapes,
    attention and loss at its micro-batch, the element-wise operators on one of its hidden-state tensors, the fixed
    costs and the optimizer."""
    import dataclasses

    from fivefold.tools.calibrate.targets import shapes_for

    cfg = reference_config(plan.threads, 1)
    mbs, seq = cfg.layout.micro_batch_size, cfg.train.seq_len
    linear, attention, loss = shapes_for([cfg.model], seq, [mbs], [1])
    return dataclasses.replace(plan, linear=linear, attention=attention, loss=loss,
                               elementwise_numel=[mbs * seq * cfg.model.hidden], model=None, passes=1, quiet=True,
                               compute=True)


def dispatch_us(measured: tuple[float, float], predicted: tuple[float, float]) -> float:
    """`selective_dispatch_us` from the reference step's seconds without and with selective recompute, measured and
    predicted by a profile without that term: the unexplained difference per block, never below 0."""
    blocks = int(REFERENCE["model.n_layers"])
    extra = (measured[1] - measured[0]) - (predicted[1] - predicted[0])
    return round(max(0.0, 1e6 * extra / blocks), 1)


def step_scale(measured_s: float, predicted_s: float) -> float:
    """measured / predicted, within `SCALE_BOUNDS`."""
    lo, hi = SCALE_BOUNDS
    return min(max(measured_s / predicted_s, lo), hi)


def heap_retention(resident_bytes: float, live_bytes: float) -> float:
    """A profile's `heap_retention`: the resident bytes a run held above its baseline per byte of live tensors the
    planner counts for it, at least 1 (an allocator that returns everything, or a resident set that could not be
    read: 0) and at most `HEAP_RETENTION_MAX`, to 4 digits."""
    if resident_bytes <= 0 or live_bytes <= 0:
        return 1.0
    return round(min(max(resident_bytes / live_bytes, 1.0), HEAP_RETENTION_MAX), 4)


def measure_heap_retention(threads: int, steps: int, warmup: int, say: Callable[[str], None]) -> float:
    """The reference model's step run by `fivefold bench` in a fresh process: its peak resident set above the
    baseline against the live tensors the planner predicts for it (`heap_retention`); 1 where /proc is missing."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from fivefold.config import dump_toml
    from fivefold.planner.hardware import get_cluster
    from fivefold.planner.predict import estimate_run
    from fivefold.sweep.runner import subprocess_env

    if not Path("/proc/self/statm").exists():
        say("heap retention: no /proc here to read a resident set; heap_retention = 1")
        return 1.0
    cfg = reference_config(threads, steps + warmup)
    live = estimate_run(cfg, get_cluster("cpu"), "cpu").peak_bytes
    with tempfile.TemporaryDirectory(prefix="fivefold-calibrate-") as d:
        config, out = Path(d) / "reference.toml", Path(d) / "result.json"
        config.write_text(dump_toml(cfg))
        cmd = [sys.executable, "-m", "fivefold", "bench", "--config", str(config), "--steps", str(steps),
               "--warmup", str(warmup), "--out", str(out)]
        done = subprocess.run(cmd, env=subprocess_env(cpu=True), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            say(f"heap retention: the reference run failed (exit {done.returncode}: {tail[0]}); heap_retention = 1")
            return 1.0
        resident = max(json.loads(out.read_text())["peak_memory_bytes_per_rank"])
    ratio = heap_retention(resident, live)
    say(f"heap retention: the reference step held {resident / 2**20:.1f} MiB resident above its baseline in a fresh "
        f"process, its live tensors {live / 2**20:.1f} MiB: heap_retention = {ratio}")
    return ratio
