"""The last phase of `fivefold calibrate` on a CPU: one whole training step of a reference model, timed through the
engine, against what the profile's parts (matmuls, attention, loss, element-wise operators, fixed costs,
optimizer) predict for it. Each part is timed alone on operands that stream from memory, between nothing else; a
real step also pays for autograd's bookkeeping, the modules' Python and the caches that one operator leaves to
the next. The step is timed right after one rank's parts (the median of 30 steps after 5), so that both see the
machine as it is then; the ratio, measured over steps / predicted from those parts, becomes the profile's
`compute_scale`, which multiplies every compute time the planner reads from the profile (communication is
measured as it runs and is not scaled).

The reference model is none of the presets: 2 layers, hidden 128, 4 heads (head dim 32) with as many key/value
heads, MLP 256, vocabulary 1024, 128 tokens per sequence, 4 sequences per step, fp32. Its hidden size, head dim and
sequence are ones the profile measures, so its parts are read inside the measured tables."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

REFERENCE = {"model.name": "calibrate-reference", "model.n_layers": "2", "model.hidden": "128",
             "model.n_heads": "4", "model.n_kv_heads": "4", "model.ffn": "256", "model.vocab_size": "1024",
             "model.max_seq_len": "128", "train.seq_len": "128", "train.global_batch_size": "4",
             "layout.micro_batch_size": "4", "train.device": "cpu", "train.dtype": "fp32", "train.warmup_steps": "0"}
# the ratio is bounded: a profile whose parts are off by more than this describes another machine, or the
# step was timed while something else ran
SCALE_BOUNDS = (0.5, 3.0)


def reference_config(threads: int, steps: int):
    """The reference run's `Config` (one process, `threads` intra-op threads)."""
    from fivefold.config import build_config

    cfg = build_config(None, {**REFERENCE, "train.threads": str(threads), "train.max_steps": str(steps)})
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


def predicted_step(cluster, threads: int) -> float:
    """The planner's step time of the reference run on `cluster` (a profile without a whole-step scale)."""
    from fivefold.planner.predict import estimate_run

    return estimate_run(reference_config(threads, 1), cluster, "cpu").step_time_s


def step_scale(measured_s: float, predicted_s: float) -> float:
    """measured / predicted, within `SCALE_BOUNDS`."""
    lo, hi = SCALE_BOUNDS
    return min(max(measured_s / predicted_s, lo), hi)
