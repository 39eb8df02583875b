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

import statistics
import time
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
    """Median seconds of the reference model's training step (forward, backward, optimizer) on this CPU."""
    from fivefold.train.build import build_engine

    cfg = reference_config(threads, steps + warmup)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = build_engine(cfg, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_len + 1),
                               generator=gen)
        micro = [(tokens[:, :-1], tokens[:, 1:])]
        global_tokens = cfg.train.global_batch_size * cfg.train.seq_len
        seconds = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            engine.forward_backward(micro, global_tokens)
            engine.optimizer_step()
            if i >= warmup:
                seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    median = statistics.median(seconds)
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
