"""`fivefold calibrate`: measure the machine it runs on and write the hardware profile that `fivefold plan
--hardware FILE` (and the sweep's predictions) read.

What it measures, with local processes on the device's own backend (gloo on CPU, the accelerator's, e.g.
nccl, on GPUs), every figure the median of repeated timings:

* linear layers: forward, and backward (input and weight gradients), for the shapes of a block and of the output
  layer of the models of interest (`--model`, `--seq-len`) at micro-batches 1..32 (1..8 on accelerators) and the
  tp degrees up to `--nproc-max` that divide the model: TFLOP/s per (m, n, k);
* causal attention (`scaled_dot_product_attention`, grouped-query as the model), forward and backward;
* element-wise bandwidth by tensor size (the time beyond an operator's fixed cost), and that fixed cost: a
  chain of the operators a block runs besides its matmuls (norm, rotary, activation, adds, casts, views) on a
  tiny tensor, forward and backward, per operator;
* the optimizer step as the engine runs it (clip, AdamW, zero): bytes streamed per second and a cost per tensor;
* collectives: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv, for every group size from 2 to
  the number of ranks running that divides it, and message sizes from 4 KiB to 16 MiB, while every rank takes
  part (the groups of one size run at once, as the groups of a layout's axis do);
* how much of an all-reduce hides behind compute running at the same time.

On a CPU the ranks of a node share its cores, and the sweep's runs put up to 4 ranks on 2 cores: every compute
figure is measured again with N processes running it at once (`--threads` intra-op threads each, 1 by default as
under `torchrun`), for N = 1..`--nproc-max`. The profile holds the figures measured with one rank at its top
level and those with N ranks under `[ranks.N]`; the planner reads the table for the ranks a layout puts on a node
(`Cluster.on_node`). On an accelerator each rank has its own device, so compute is measured once.

Nothing here is fitted to training runs: the planner's predictions for the runs are built from these figures and
the model's shapes and operator counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.config import ConfigError, write_text_atomic
from fivefold.faults import DEFAULT_COLLECTIVE_TIMEOUT_S, die_with_parent
from fivefold.parallel.tensor_comm import all_gather_into, reduce_scatter_into
from fivefold.planner.hardware import COLLECTIVES

KIB = 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="profile to write (default: calibrated-DEVICE.toml)")
    p.add_argument("--device", default="auto", help="cpu, cuda, xpu, ... (default: the accelerator if any, else cpu)")
    p.add_argument("--nproc-max", type=int, default=0,
                   help="most ranks to run at once (default: 4 on CPU, the device count on accelerators)")
    p.add_argument("--model", default="",
                   help="comma-separated presets whose shapes to measure (default: tiny on CPU, llama-3.2-1b on GPU)")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length of those shapes (default: 128 on CPU, "
                                                          "4096 on GPU)")
    p.add_argument("--threads", type=int, default=1, help="CPU: intra-op threads per rank (1, as torchrun sets)")
    p.add_argument("--quick", action="store_true",
                   help="a coarse profile in seconds (2 ranks, few shapes and sizes, short timings): for tests")


@dataclass
class Plan:
    """What one group of ranks measures."""

    device_type: str
    threads: int
    linear: list[tuple[int, int, int]]
    attention: list[tuple[int, int, int, int, int]]  # batch, heads, kv heads, seq, head dim
    loss: list[tuple[int, int, int]]  # tokens per chunk, vocabulary, hidden
    elementwise_numel: list[int]
    message_bytes: list[int]
    optimizer_numel: int
    min_seconds: float  # timing budget per measured point
    sample_seconds: float  # shortest sample (see `Clock.time`)
    model: object = None  # the (first) model of interest: its block is the ZeRO-3 unit timed
    passes: int = 2  # timing passes over the shapes and the collectives
    compute: bool = True
    quiet: bool = False
    kinds: tuple[str, ...] = COLLECTIVES


@dataclass
class Result:
    """Figures of one group of ranks (the same on every rank: each sample lasts until the slowest is done)."""

    ranks: int
    linear: list[list[float]] = field(default_factory=list)
    attention: list[list[float]] = field(default_factory=list)
    loss: list[list[float]] = field(default_factory=list)
    elementwise: list[list[float]] = field(default_factory=list)
    kernel_overhead_us: float = 0.0
    backward_overhead_us: float = 0.0
    optimizer_gbps: float = 0.0
    optimizer_tensor_us: float = 0.0
    collectives: dict[str, dict[int, list[list[float]]]] = field(default_factory=dict)
    comm_overlap: float = 1.0
    zero3_unit_us: float = 0.0
    collective_wait: list[list[float]] = field(default_factory=list)
    posted_p2p_wait_us: float = 0.0
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------------------------
# What to measure


def shapes_for(models: list, seq: int, micro_batches: list[int], tps: list[int]) -> tuple[list, list, list]:
    """Linear (m, n, k) and attention (batch, heads, kv heads, seq, head dim) shapes of the models' blocks, and
    output layer + loss (tokens per chunk, vocabulary, hidden) shapes, on one tp rank, as the planner's time
    model asks for them."""
    from fivefold.planner.search import tp_valid
    from fivefold.planner.time import _linear_shapes
    from fivefold.train.engine import LOSS_CHUNK_TOKENS

    linear: set[tuple[int, int, int]] = set()
    loss: set[tuple[int, int, int]] = set()
    attention: set[tuple[int, int, int, int, int]] = set()
    for cfg in models:
        for tp in tps:
            if tp_valid(cfg, tp):
                continue
            for mbs in micro_batches:
                tokens = mbs * seq
                for m, n, k in _linear_shapes(cfg, tokens, tp, fused=False):
                    linear.add((int(m), int(n), int(k)))
                chunk = min(tokens, LOSS_CHUNK_TOKENS if tp == 1 else 4096)
                loss.add((chunk, cfg.vocab_size // tp, cfg.hidden))
                attention.add((mbs, cfg.n_heads // tp, max(cfg.n_kv_heads // tp, 1), seq, cfg.head_dim))
    # the planner looks attention up by (batch x heads, seq, head dim): one shape per key
    unique = {(b * h, s, d): (b, h, kvh, s, d) for b, h, kvh, s, d in sorted(attention, reverse=True)}
    return sorted(linear), sorted(unique.values()), sorted(loss)


def make_plan(args: argparse.Namespace, device_type: str) -> tuple[Plan, list[int]]:
    """The measurement plan and the rank counts to run it with."""
    from fivefold.models.presets import get_preset

    cpu = device_type == "cpu"
    names = [m for m in (args.model or ("tiny" if cpu else "llama-3.2-1b")).split(",") if m]
    models = [get_preset(n) for n in names]
    seq = args.seq_len or (128 if cpu else 4096)
    if seq < 8:
        raise ConfigError(f"--seq-len = {seq} must be >= 8")
    nproc = args.nproc_max or (4 if cpu else max(torch.accelerator.device_count(), 1))
    if args.quick:
        nproc = min(nproc, 2) if args.nproc_max == 0 else nproc
    if nproc < 1:
        raise ConfigError(f"--nproc-max = {nproc} must be >= 1")
    if not cpu and nproc > torch.accelerator.device_count():
        raise ConfigError(f"--nproc-max = {nproc} exceeds the {torch.accelerator.device_count()} {device_type} "
                          "devices of this machine")
    if args.threads < 1:
        raise ConfigError(f"--threads = {args.threads} must be >= 1")
    tps = [t for t in (1, 2, 4, 8) if t <= nproc]
    if args.quick:
        mbs, sizes, elem = [2], [4 * KIB, 1024 * KIB], [2**12, 2**20]
        min_seconds, opt_numel = 0.003, 2**16
    else:
        mbs = [1, 2, 4, 8, 16, 32] if cpu else [1, 2, 4, 8]
        sizes = [4 * KIB * 4**i for i in range(7)]  # 4 KiB .. 16 MiB
        elem = [2**i for i in range(10, 25, 2)]
        min_seconds, opt_numel = 0.05, 2**21
    linear, attention, loss = shapes_for(models, seq, mbs, tps)
    plan = Plan(device_type, args.threads, linear, attention, loss, elem, sizes, opt_numel, min_seconds,
                0.005 if args.quick else 0.03, model=models[0], passes=1 if args.quick else 2)
    return plan, list(range(1, nproc + 1))


# ---------------------------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Synchronised timings that every rank of the group runs together (same repetitions, started at a barrier),
    so that ranks sharing cores compete as in a training step."""

    def __init__(self, device: torch.device, group_size: int, min_seconds: float, sample_seconds: float = 0.0) -> None:
        self.device, self.group_size, self.min_seconds = device, group_size, min_seconds
        self.sample_seconds = sample_seconds

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def _agree(self, value: float) -> float:
        """The largest `value` over the ranks (every rank then runs as many repetitions)."""
        if self.group_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._cpu_group())
        return float(t.item())

    def _cpu_group(self):
        return None if self.device.type == "cpu" else _group_cache.setdefault("g", dist.new_group(backend="gloo"))

    def barrier(self) -> None:
        if self.group_size > 1:
            dist.barrier(group=self._cpu_group())

    def time(self, *phases: Callable[[], object]) -> list[float]:
        """Seconds per call of each phase after one warm-up round. A sample repeats a phase for at least
        `sample_seconds` (several of the scheduler's time slices) on every rank at once, from a barrier, and lasts
        until the slowest rank is done: ranks sharing cores are timed sharing them. The figure is the lower
        quartile of the samples, since other work on the machine only ever slows a sample down."""
        for phase in phases:
            phase()
        self.sync()
        t0 = time.perf_counter()
        for phase in phases:
            phase()
        self.sync()
        once = self._agree(time.perf_counter() - t0)
        calls = max(1, math.ceil(self.sample_seconds / max(once, 1e-9)))
        reps = int(min(50, max(3, self.min_seconds / max(once * calls, 1e-9))))
        samples = torch.zeros(len(phases), reps, dtype=torch.float64)
        for r in range(reps):
            for i, phase in enumerate(phases):
                self.barrier()  # every rank starts each sample together, so that they share the cores throughout
                t0 = time.perf_counter()
                for _ in range(calls):
                    phase()
                self.sync()
                samples[i, r] = (time.perf_counter() - t0) / calls
        if self.group_size > 1:  # a sample lasts until its slowest rank is done, as a step would
            dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=self._cpu_group())
        return [lower_quartile(row.tolist()) for row in samples]


_group_cache: dict = {}  # process groups of this calibration run: "g" (gloo beside nccl), "sizes" (by size)


def lower_quartile(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=4, method="inclusive")[0] if len(samples) > 1 else samples[0]


# ---------------------------------------------------------------------------------------------------------------
# Compute


# Operands of a timed call are rotated through sets spanning more than the caches (a CPU's L3, a GPU's L2), so
# that every call starts from memory as in a training step, where the other layers' work has evicted them.
COLD_SPAN_BYTES = 96 * 2**20
MAX_SETS = 64


def operand_sets(set_bytes: int) -> int:
    """How many copies of operands of `set_bytes` to rotate through so that each call finds them uncached."""
    return max(1, min(MAX_SETS, math.ceil(COLD_SPAN_BYTES / max(set_bytes, 1))))


def _forward_backward(clock: Clock, make: Callable[[], tuple[Callable[[], torch.Tensor], list[torch.Tensor],
                                                             torch.Tensor]], set_bytes: int) -> tuple[float, float]:
    """Seconds of a call with autograd recording, and of its backward, over rotating operand sets: `make()`
    returns one set, (the call, the leaves it differentiates, the output gradient)."""
    sets = [make() for _ in range(operand_sets(set_bytes))]
    forward_sets, backward_sets = itertools.cycle(sets), itertools.cycle(sets)
    out: list[torch.Tensor] = []

    def forward() -> None:
        fn, leaves, _ = next(forward_sets)
        for t in leaves:
            t.grad = None
        out.append(fn())

    def backward() -> None:
        out.pop().backward(next(backward_sets)[2])

    fwd, bwd = clock.time(forward, backward)
    return fwd, bwd


def _tflops(clock: Clock, make, set_bytes: int, flops: float) -> list[float]:
    """[forward, backward] TFLOP/s of a call doing `flops` forward (twice that backward), timed as
    `_forward_backward` times it."""
    fwd, bwd = _forward_backward(clock, make, set_bytes)
    return [flops / fwd / 1e12, 2 * flops / bwd / 1e12]


def two_passes(measure: Callable[[list], list[list[float]]], shapes: list, keys: int, passes: int) -> list[list[float]]:
    """Measure `shapes` `passes` times, the second in reverse order, keeping each shape's best throughputs: a
    burst of other work on the machine slows a stretch of shapes, rarely the same shape in both passes."""
    rows = measure(shapes)
    for _ in range(passes - 1):
        again = {tuple(r[:keys]): r for r in measure(shapes[::-1])}
        rows = [r[:keys] + [max(a, b) for a, b in zip(r[keys:], again[tuple(r[:keys])][keys:], strict=True)]
                for r in rows]
    return rows


def measure_linear(clock: Clock, shapes, dtype: torch.dtype, say) -> list[list[float]]:
    rows = []
    for i, (m, n, k) in enumerate(shapes):
        def make(m=m, n=n, k=k):
            x = torch.randn(1, m, k, device=clock.device, dtype=dtype, requires_grad=True)
            w = (torch.randn(n, k, device=clock.device, dtype=dtype) * 0.02).requires_grad_()
            g = torch.randn(1, m, n, device=clock.device, dtype=dtype)
            return (lambda: F.linear(x, w)), [x, w], g

        rows.append([m, n, k, *_tflops(clock, make, 2 * (m * k + n * k + m * n) * dtype.itemsize, 2 * m * n * k)])
        if (i + 1) % 10 == 0 or i + 1 == len(shapes):
            say(f"linear {i + 1}/{len(shapes)} (last {m}x{n}x{k}: forward {rows[-1][3]:.3g}, backward "
                f"{rows[-1][4]:.3g} TFLOP/s)")
    return rows


def measure_attention(clock: Clock, shapes, dtype: torch.dtype, say) -> list[list[float]]:
    rows = []
    for b, h, kvh, s, d in shapes:
        def make(b=b, h=h, kvh=kvh, s=s, d=d):
            q = torch.randn(b, h, s, d, device=clock.device, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(b, kvh, s, d, device=clock.device, dtype=dtype, requires_grad=True)
                    for _ in range(2))
            g = torch.randn(b, h, s, d, device=clock.device, dtype=dtype)
            return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kvh)), \
                [q, k, v], g

        flops = 2 * b * h * s * s * d  # causal: half of 4 b h s^2 d
        rows.append([b * h, s, d, *_tflops(clock, make, 2 * b * s * d * (3 * h + 2 * kvh) * dtype.itemsize, flops)])
    say(f"attention {len(shapes)} shapes (last {shapes[-1]}: forward {rows[-1][3]:.3g} TFLOP/s)")
    return rows


def measure_loss(clock: Clock, shapes, dtype: torch.dtype, say) -> list[list[float]]:
    """The engine's fused output layer + cross-entropy on one chunk of tokens (it computes its gradients in the
    forward; the backward scales them), by (tokens, vocabulary, hidden)."""
    from fivefold.train.loss import linear_cross_entropy_sum

    rows = []
    for m, n, k in shapes:
        def make(m=m, n=n, k=k):
            hidden = torch.randn(m, k, device=clock.device, dtype=dtype, requires_grad=True)
            weight = (torch.randn(n, k, device=clock.device, dtype=dtype) * 0.02).requires_grad_()
            targets = torch.randint(0, n, (m,), device=clock.device)
            return (lambda: linear_cross_entropy_sum(hidden, weight, targets, m, dtype)), [hidden, weight], \
                torch.ones((), device=clock.device, dtype=torch.float32)

        rows.append([m, n, k, *_tflops(clock, make, 2 * (m * k + n * k) * dtype.itemsize, 2 * m * n * k)])
    m, n, k, fwd, bwd = rows[-1]  # TFLOP/s
    ms = 2 * m * n * k * (1 / fwd + 2 / bwd) / 1e9
    say(f"output layer + loss {len(shapes)} shapes (last {shapes[-1]}: {ms:.3g} ms)")
    return rows


OPS_PER_UNIT = 19  # operators in `_fixed_cost_unit`


def _fixed_cost_unit(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kinds of operators a block runs besides its matmuls, in about their proportions: an RMSNorm, a rotary
    rotation, views, an activation, casts and residual adds (19 operators)."""
    b, s, d = x.shape
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    y = (y * w).to(x.dtype)
    lo, hi = y.chunk(2, dim=-1)
    y = torch.cat([-hi, lo], dim=-1) * 0.5 + y
    y = y.view(b, s, 2, d // 2).transpose(1, 2).transpose(1, 2).reshape(b, s, d)
    y = F.silu(y) * y
    return y + x


def measure_fixed_cost(clock: Clock, dtype: torch.dtype, say) -> tuple[float, float]:
    """Seconds per operator of the forward and of its backward, on a tiny tensor (no work to speak of)."""
    units = 10
    x = torch.randn(1, 8, 64, device=clock.device, dtype=dtype, requires_grad=True)
    w = torch.randn(64, device=clock.device, dtype=dtype, requires_grad=True)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(units):
            y = _fixed_cost_unit(y, w)
        return y.sum()

    one = (chain, [x, w], torch.ones((), device=clock.device, dtype=dtype))
    fwd, bwd = _forward_backward(clock, lambda: one, COLD_SPAN_BYTES)  # fixed costs: one set, kept in cache
    ops = units * OPS_PER_UNIT
    say(f"operator fixed cost: forward {1e6 * fwd / ops:.1f} us, backward {1e6 * bwd / ops:.1f} us")
    return fwd / ops, bwd / ops


def measure_elementwise(clock: Clock, numels: list[int], dtype: torch.dtype, say) -> list[list[float]]:
    """GB/s of a binary element-wise operator beyond its fixed cost, by the bytes of one operand (operands
    rotated through sets beyond the caches, as `_forward_backward`)."""
    tiny = torch.ones(16, device=clock.device, dtype=dtype)
    base = clock.time(lambda: torch.mul(tiny, tiny))[0]
    rows = []
    for n in numels:
        nbytes = n * dtype.itemsize
        pairs = itertools.cycle([(torch.randn(n, device=clock.device, dtype=dtype),
                                  torch.randn(n, device=clock.device, dtype=dtype))
                                 for _ in range(operand_sets(3 * nbytes))])

        def mul(pairs=pairs) -> None:
            torch.mul(*next(pairs))

        seconds = clock.time(mul)[0]
        rows.append([nbytes, 3 * nbytes / max(seconds - base, seconds * 0.05) / 1e9])
    say("element-wise GB/s by operand size: " + ", ".join(f"{_size(int(r[0]))} {r[1]:.3g}" for r in rows))
    return rows


def measure_optimizer(clock: Clock, numel: int, say) -> tuple[float, float]:
    """The engine's optimizer step (clip the gradient norm, AdamW, zero the gradients) on fp32 parameters:
    bytes of parameters, gradients and the two moments streamed per second on one large tensor, and the cost
    per tensor on many small ones."""
    from torch import nn

    from fivefold.config import TrainConfig
    from fivefold.train.optim import build_adamw

    def step_time(shapes: list[int]) -> float:
        params = nn.ParameterList([nn.Parameter(torch.randn(n, 1, device=clock.device)) for n in shapes])
        grads = [torch.randn_like(p) for p in params]
        opt = build_adamw(params, TrainConfig(), clock.device)

        def step() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return clock.time(step)[0]

    tensors = 64
    big = step_time([numel])
    small = step_time([16] * tensors)
    gbps = 16 * numel / max(big - small / tensors, big * 0.05) / 1e9
    per_tensor = small / tensors
    say(f"optimizer step: {gbps:.3g} GB/s of states, {1e6 * per_tensor:.1f} us per tensor")
    return gbps, per_tensor


# ---------------------------------------------------------------------------------------------------------------
# Collectives


def _size_groups(world: int, rank: int) -> dict[int, dist.ProcessGroup]:
    """This rank's group of each size 2..world that divides world (the world / size groups of consecutive ranks
    run at once, as a layout's groups do); created once per process, every rank in the same order."""
    if "sizes" not in _group_cache:
        groups = {}
        for size in [n for n in range(2, world + 1) if world % n == 0]:
            every = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
            groups[size] = every[rank // size]
        _group_cache["sizes"] = groups
    return _group_cache["sizes"]


def _compute_burst(clock: Clock, dtype: torch.dtype) -> Callable[[], None]:
    """A few milliseconds of matmuls: the compute that ranks do between communications in the wait timings."""
    a = torch.randn(128, 384, device=clock.device, dtype=dtype)
    b = torch.randn(384, 128, device=clock.device, dtype=dtype)

    def compute() -> None:
        for _ in range(16):
            a @ b

    return compute


def measure_collectives(clock: Clock, world: int, rank: int, plan: Plan, say,
                        reverse: bool = False) -> dict[str, dict[int, list]]:
    """Seconds per call by kind, group size and message bytes (the buffer each rank contributes for all-reduce
    and all-to-all, the full buffer for all-gather and reduce-scatter, one message for send/recv)."""
    out: dict[str, dict[int, list]] = {k: {} for k in plan.kinds}
    device = clock.device
    for size, group in _size_groups(world, rank).items():
        peer = rank ^ 1  # send/recv between neighbours
        for kind in plan.kinds:
            if kind == "p2p" and size != 2:
                continue
            rows = []
            for nbytes in plan.message_bytes[::-1] if reverse else plan.message_bytes:
                numel = max(size, nbytes // 4 // size * size)
                full = torch.zeros(numel, device=device)
                part = torch.zeros(numel // size, device=device)
                other = torch.zeros(numel, device=device)
                call: Callable[[], object]
                if kind == "all_reduce":
                    def call(full=full, group=group):
                        return dist.all_reduce(full, group=group)
                elif kind == "all_gather":
                    def call(full=full, part=part, group=group):
                        return all_gather_into(full, part, group=group)
                elif kind == "reduce_scatter":
                    def call(full=full, part=part, group=group):
                        return reduce_scatter_into(part, full, group=group)
                elif kind == "all_to_all":
                    def call(full=full, other=other, group=group):
                        return dist.all_to_all_single(other, full, group=group)
                else:
                    def call(full=full, peer=peer):  # one message each way: half the round trip
                        if rank % 2 == 0:
                            dist.send(full, peer)
                            dist.recv(full, peer)
                        else:
                            dist.recv(full, peer)
                            dist.send(full, peer)
                seconds = clock.time(call)[0]
                rows.append([numel * 4, seconds / 2 if kind == "p2p" else seconds])
            out[kind][size] = sorted(rows)  # every rank holds the same figures (see `Clock.time`)
        say(f"collectives over groups of {size} of {world} ranks: all-reduce " + ", ".join(
            f"{_size(int(b))} {1e3 * s:.3g} ms" for b, s in out['all_reduce'][size]))
    return {k: v for k, v in out.items() if v}


def monotone(rows: list[list[float]]) -> list[list[float]]:
    """(bytes, seconds) rows with each time no longer than any larger message's: a smaller message cannot take
    longer, so a slower figure is noise (a burst of other work, a first call)."""
    out = [list(r) for r in rows]
    for i in range(len(out) - 2, -1, -1):
        out[i][1] = min(out[i][1], out[i + 1][1])
    return out


def measure_zero3_unit(clock: Clock, model, collectives: dict, say) -> float:
    """Seconds per micro-batch that one ZeRO-3 unit (`fully_shard` around a block of `model`, as the engine
    wraps each block) costs beyond its two all-gathers and one reduce-scatter: hooks, copies in and out, frees.
    A block on 8 tokens, sharded over all ranks, against the same block unsharded; the collectives of the
    block's bytes (from this calibration's tables) are subtracted."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from fivefold.models.llama import Block, rope_cos_sin

    def build() -> nn.Module:
        torch.manual_seed(0)
        block = Block(model).to(clock.device)
        block.attn.core = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                          enable_gqa=q.shape[1] != k.shape[1])
        return block

    class Root(nn.Module):  # the engine's root unit around the whole micro-batch (it holds no parameters here)
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.block(*args)

    plain, sharded = build(), build()
    root = Root(sharded)
    mesh = DeviceMesh.from_group(dist.group.WORLD, clock.device.type)
    unit, outer = fully_shard(sharded, mesh=mesh), fully_shard(root, mesh=mesh)
    for u in (unit, outer):
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)
    x = torch.randn(1, 8, model.hidden, device=clock.device, requires_grad=True)
    cos, sin = rope_cos_sin(model, torch.arange(8, device=clock.device))

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            module(x, cos, sin).sum().backward()
        return run

    t_plain, t_sharded = clock.time(step(plain), step(root))
    nbytes = sum(p.numel() for p in plain.parameters()) * 4
    world = dist.get_world_size()

    def table(kind: str) -> float:
        rows = collectives.get(kind, {}).get(world)
        if not rows:
            return 0.0
        from fivefold.planner.hardware import _loglog

        return _loglog(tuple((b, sec) for b, sec in rows), nbytes)

    overhead = max(0.0, t_sharded - t_plain - 2 * table("all_gather") - table("reduce_scatter"))
    say(f"ZeRO-3 unit: {1e3 * (t_sharded - t_plain):.2f} ms per micro-batch with its collectives, "
        f"{1e3 * overhead:.2f} ms beyond them")
    return overhead


def measure_collective_wait(clock: Clock, world: int, rank: int, dtype: torch.dtype, say) -> list[list[float]]:
    """Seconds a blocking collective costs beyond its own time when the ranks compute between calls, as in a
    training step, by group size: a rank reaching the collective waits for its peers, which on shared cores may
    not be running at that moment. (compute, then a 64 KiB all-reduce) - compute alone - the all-reduce alone."""
    compute = _compute_burst(clock, dtype)
    buffer = torch.zeros(16 * KIB, device=clock.device)
    rows = []
    for size, group in _size_groups(world, rank).items():
        def communicate(group=group) -> None:
            dist.all_reduce(buffer, group=group)

        def both(group=group) -> None:
            compute()
            dist.all_reduce(buffer, group=group)

        t_compute, t_comm, t_both = clock.time(compute, communicate, both)
        rows.append([size, max(t_both - t_compute - t_comm, 1e-7)])
    say("collective wait between compute: " + ", ".join(f"groups of {int(n)} {1e3 * w:.2f} ms" for n, w in rows))
    return rows


def measure_posted_p2p_wait(clock: Clock, world: int, rank: int, dtype: torch.dtype, say) -> float:
    """Seconds a ring shift posted before compute and waited for after it (context parallel's K/V transfers)
    adds beyond the compute and its own time: on shared cores the transfer progresses only when the
    communication thread gets a core. (post a 128 KiB shift around all ranks, compute, wait) - compute - the
    shift alone."""
    compute = _compute_burst(clock, dtype)
    send = torch.zeros(32 * KIB, device=clock.device)
    received = torch.empty_like(send)

    def post() -> list:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, received, (rank - 1) % world)])

    def shift() -> None:
        for work in post():
            work.wait()

    def both() -> None:
        works = post()
        compute()
        for work in works:
            work.wait()

    t_compute, t_shift, t_both = clock.time(compute, shift, both)
    wait = max(t_both - t_compute - t_shift, 0.0)
    say(f"ring shift posted before compute: {1e3 * wait:.2f} ms beyond compute {1e3 * t_compute:.2f} ms and the "
        f"shift alone {1e3 * t_shift:.2f} ms")
    return wait


def measure_overlap(clock: Clock, dtype: torch.dtype, say) -> float:
    """Share of an all-reduce over all ranks that hides behind matmuls running at the same time: (compute +
    communication - both at once) / the shorter of the two, in [0, 1]."""
    a = torch.randn(256, 256, device=clock.device, dtype=dtype)
    buffer = torch.zeros(2**20, device=clock.device)

    def compute() -> None:
        for _ in range(8):
            a @ a

    def communicate() -> None:
        dist.all_reduce(buffer)

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        compute()
        work.wait()

    t_compute, t_comm, t_both = clock.time(compute, communicate, both)
    overlap = (t_compute + t_comm - t_both) / max(min(t_compute, t_comm), 1e-12)
    overlap = min(1.0, max(0.0, overlap))
    say(f"overlap of an all-reduce with compute: {overlap:.2f} (compute {1e3 * t_compute:.2f} ms, all-reduce "
        f"{1e3 * t_comm:.2f} ms, both {1e3 * t_both:.2f} ms)")
    return overlap


# ---------------------------------------------------------------------------------------------------------------
# One group of ranks


def run_ranks(rank: int, world: int, plan: Plan, port: int, out_path: str) -> None:
    """Entry point of each process: join the group, measure, and (rank 0) write the figures."""
    start = time.perf_counter()
    device = torch.device(plan.device_type) if plan.device_type == "cpu" else \
        torch.device(plan.device_type, rank)
    if plan.device_type == "cpu":
        torch.set_num_threads(plan.threads)
    else:
        torch.accelerator.set_device_index(rank)
    if world > 1:
        die_with_parent()  # a killed `fivefold calibrate` leaves no rank behind
        backend = "gloo" if plan.device_type == "cpu" else dist.get_default_backend_for_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S))
    prefix = f"[{world} rank{'s' if world > 1 else ''}]"

    def say(text: str) -> None:
        if rank == 0 and not plan.quiet:
            print(f"calibrate {prefix} {text}", flush=True)

    dtype = torch.float32 if plan.device_type == "cpu" else torch.bfloat16
    clock = Clock(device, world, plan.min_seconds, plan.sample_seconds)
    result = Result(world)
    if plan.compute:
        result.linear = two_passes(lambda s: measure_linear(clock, s, dtype, say), plan.linear, 3, plan.passes)
        result.attention = two_passes(lambda s: measure_attention(clock, s, dtype, say), plan.attention, 3,
                                      plan.passes)
        result.loss = two_passes(lambda s: measure_loss(clock, s, dtype, say), plan.loss, 3, plan.passes)
        long_clock = Clock(device, world, 6 * plan.min_seconds, plan.sample_seconds)
        fixed = [measure_fixed_cost(long_clock, dtype, say) for _ in range(plan.passes)]
        result.kernel_overhead_us = 1e6 * min(f for f, _ in fixed)
        result.backward_overhead_us = 1e6 * min(b for _, b in fixed)
        result.elementwise = two_passes(lambda n: measure_elementwise(clock, n, dtype, say), plan.elementwise_numel,
                                        1, plan.passes)
        optimizer = [measure_optimizer(long_clock, plan.optimizer_numel, say) for _ in range(plan.passes)]
        result.optimizer_gbps = max(g for g, _ in optimizer)
        result.optimizer_tensor_us = 1e6 * min(t for _, t in optimizer)
    if world > 1:
        passes = [measure_collectives(clock, world, rank, plan, say, reverse=i % 2 == 1) for i in range(plan.passes)]
        result.collectives = {kind: {size: monotone([[b, min(p[kind][size][j][1] for p in passes)]
                                                     for j, (b, _) in enumerate(rows)])
                                     for size, rows in groups.items()}
                              for kind, groups in passes[0].items()}
        result.comm_overlap = measure_overlap(clock, dtype, say)
        # waits are the ranks' own contention for the cores, not noise on top of a figure: the mean of several
        # passes (a single pass reads anywhere between none and a scheduler time slice)
        passes = 2 * plan.passes
        waits = [measure_collective_wait(clock, world, rank, dtype, say) for _ in range(passes)]
        result.collective_wait = [[row[0], statistics.fmean(w[i][1] for w in waits)] for i, row in enumerate(waits[0])]
        result.posted_p2p_wait_us = 1e6 * statistics.fmean(measure_posted_p2p_wait(clock, world, rank, dtype, say)
                                                           for _ in range(passes))
        if plan.model is not None:
            result.zero3_unit_us = 1e6 * measure_zero3_unit(clock, plan.model, result.collectives, say)
    result.seconds = time.perf_counter() - start
    if rank == 0:
        Path(out_path).write_text(json.dumps(asdict(result)))
    if world > 1:
        dist.barrier()
        _group_cache.clear()  # the groups end with the process group
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_group(plan: Plan, world: int) -> Result:
    """Run `plan` on `world` local processes (in this process when 1) and return rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        if world == 1:
            threads = torch.get_num_threads()
            try:
                run_ranks(0, 1, plan, 0, out)
            finally:
                torch.set_num_threads(threads)
        else:
            import torch.multiprocessing as mp

            mp.start_processes(run_ranks, args=(world, plan, _free_port(), out), nprocs=world,
                               start_method="spawn")
        data = json.loads(Path(out).read_text())
    data["collectives"] = {k: {int(s): rows for s, rows in v.items()} for k, v in data["collectives"].items()}
    return Result(**data)


# ---------------------------------------------------------------------------------------------------------------
# The profile


def fit_link(rows: list[list[float]], size: int) -> tuple[float, float]:
    """Per-step latency (s) and bus bandwidth (bytes/s) of a ring all-reduce that best fit measured (bytes,
    seconds): t = 2 (n - 1) latency + 2 (n - 1) / n bytes / bandwidth, least squares on relative error."""
    steps, frac = 2 * (size - 1), 2 * (size - 1) / size
    # t / t_i = a * steps / t_i + c * frac * b_i / t_i with a = latency, c = 1 / bandwidth; weights 1 / t_i
    s11 = s12 = s22 = r1 = r2 = 0.0
    for nbytes, seconds in rows:
        x1, x2 = steps / seconds, frac * nbytes / seconds
        s11, s12, s22 = s11 + x1 * x1, s12 + x1 * x2, s22 + x2 * x2
        r1, r2 = r1 + x1, r2 + x2
    det = s11 * s22 - s12 * s12
    latency = (r1 * s22 - r2 * s12) / det if det else 0.0
    inv_bw = (s11 * r2 - s12 * r1) / det if det else 0.0
    if latency <= 0 or inv_bw <= 0:  # one term explains it all: keep the other small but positive
        latency = max(latency, min(s for _, s in rows) / steps * 0.01)
        inv_bw = max(inv_bw, 1e-12)
    return latency, 1 / inv_bw


def profile_tables(results: dict[int, Result], device_type: str, threads: int, nproc: int, name: str) -> dict:
    """The TOML tables of a profile: top level from one rank, [ranks.N] from N ranks."""
    from fivefold.planner.predict import default_hardware

    one = results[1]
    cpu = device_type == "cpu"
    best = max(r[3] for r in one.linear)
    top: dict = {"name": name, "base": default_hardware(device_type).name}
    if cpu:
        top["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        top["threads_per_rank"] = threads
        top["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        top["fp32_tflops"] = top["bf16_tflops"] = best
        top["hbm_gbps"] = max(r[1] for r in one.elementwise)
    else:
        top["matmul_efficiency"] = 1.0  # the tables hold what is achieved
    top["gpus_per_node"] = nproc
    top.update(_compute_fields(one))
    if 2 in results and results[2].collectives.get("all_reduce", {}).get(2):
        latency, bandwidth = fit_link(results[2].collectives["all_reduce"][2], 2)
        top["intra_latency_us"], top["intra_node_gbps"] = 1e6 * latency, bandwidth / 1e9
    ranks = {}
    for n, r in sorted(results.items()):
        if n == 1:
            continue
        section = _compute_fields(r) if cpu else {}
        section["comm_overlap"] = r.comm_overlap
        section["zero3_unit_us"] = r.zero3_unit_us
        section["posted_p2p_wait_us"] = r.posted_p2p_wait_us
        if r.collective_wait:
            section["collective_wait"] = r.collective_wait
        section["collectives"] = {k: {str(s): rows for s, rows in v.items()} for k, v in r.collectives.items()}
        ranks[str(n)] = section
    if ranks:
        top["ranks"] = ranks
    return top


def _compute_fields(r: Result) -> dict:
    fields = {"kernel_overhead_us": r.kernel_overhead_us, "backward_overhead_us": r.backward_overhead_us,
              "optimizer_gbps": r.optimizer_gbps, "optimizer_tensor_us": r.optimizer_tensor_us,
              "linear": r.linear, "attention": r.attention, "loss": r.loss, "elementwise": r.elementwise}
    return {k: v for k, v in fields.items() if v != []}


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def _value(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        if v and isinstance(v[0], list):
            return "[\n" + "".join(f"  {_value(row)},\n" for row in v) + "]"
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return _number(v)


def to_toml(tables: dict, header: str = "") -> str:
    """TOML text of nested dicts of numbers, strings and lists (the profile's shape)."""
    lines = [f"# {line}" for line in header.splitlines()]

    def emit(d: dict, path: list[str]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        subs = {k: v for k, v in d.items() if isinstance(v, dict)}
        if path and scalars:
            lines.append(f"\n[{'.'.join(path)}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_value(v)}")
        for k, v in subs.items():
            emit(v, [*path, k])

    emit(tables, [])
    return "\n".join(lines) + "\n"


def calibrate(args: argparse.Namespace) -> tuple[Path, dict[int, Result], float]:
    from fivefold.train.preflight import check_device

    if args.seq_len < 0:
        raise ConfigError(f"--seq-len = {args.seq_len} must be >= 1 (or 0 for the default)")
    if args.nproc_max < 0:
        raise ConfigError(f"--nproc-max = {args.nproc_max} must be >= 1 (or 0 for the default)")
    try:
        device_type = check_device(args.device).type
    except ConfigError as e:
        raise ConfigError(str(e).replace("train.device", "--device")) from None
    plan, levels = make_plan(args, device_type)
    out = Path(args.out or f"calibrated-{device_type}.toml")
    if not out.parent.is_dir() or out.is_dir():  # before the minutes of measuring, not after
        why = "is a directory" if out.is_dir() else "its directory does not exist"
        raise ConfigError(f"--out {str(out)!r}: {why}; "
                          "give a file name in an existing directory, e.g. calibrated-cpu.toml")
    print(f"calibrate: {device_type}, ranks {levels[0]}..{levels[-1]}, {len(plan.linear)} linear, "
          f"{len(plan.attention)} attention and {len(plan.loss)} loss shapes, {len(plan.message_bytes)} message sizes"
          f"{' (quick)' if args.quick else ''}", flush=True)
    start = time.perf_counter()
    load_before = _load_note()
    results: dict[int, Result] = {}
    for n in levels:
        results[n] = measure_group(dataclasses.replace(plan, compute=device_type == "cpu" or n == 1), n)
        print(f"calibrate: {n} rank{'s' if n > 1 else ''} done in {results[n].seconds:.0f} s", flush=True)
    seconds = time.perf_counter() - start
    load = f"load average {load_before} before, {_load_note()} after (cores: {os.cpu_count()})"
    print(f"calibrate: {load}", flush=True)
    header = (f"written by `fivefold calibrate{' --quick' if args.quick else ''}` on {socket.gethostname()} "
              f"({device_type}, torch {torch.__version__}) in {seconds:.0f} s, {time.strftime('%Y-%m-%d %H:%M')}\n"
              "top level: measured with 1 rank; [ranks.N]: with N ranks running at once on this machine.\n"
              "linear rows: m, n, k, forward TFLOP/s, backward TFLOP/s; attention rows: batch x heads, seq, "
              "head dim, forward, backward TFLOP/s;\nloss rows: tokens, vocabulary, hidden, forward, backward "
              "TFLOP/s (of the output layer's matmul);\nelement-wise rows: operand bytes, GB/s; collectives: "
              f"[ranks.N.collectives.KIND] group size = [[bytes, seconds], ...]\n{load}")
    from fivefold.planner.hardware import PRESETS

    # named after the file, never like a built-in profile (a store's predictions name the profile they used)
    name = out.stem if out.stem.lower() not in PRESETS else f"{out.stem}-calibrated"
    tables = profile_tables(results, device_type, args.threads, levels[-1], name)
    write_text_atomic(out, to_toml(tables, header))
    return out, results, seconds


def run(args: argparse.Namespace) -> int:
    out, results, seconds = calibrate(args)
    one = results[1]
    print(f"wrote {out} in {seconds:.0f} s: best linear {max(r[3] for r in one.linear):.3g} TFLOP/s, operator "
          f"{one.kernel_overhead_us:.1f} + {one.backward_overhead_us:.1f} us (forward + backward), optimizer "
          f"{one.optimizer_gbps:.3g} GB/s")
    for n, r in sorted(results.items()):
        ar = r.collectives.get("all_reduce", {}).get(n)
        if ar:
            print(f"  {n} ranks: all-reduce of {_size(int(ar[0][0]))} {1e6 * ar[0][1]:.0f} us, of "
                  f"{_size(int(ar[-1][0]))} {1e3 * ar[-1][1]:.1f} ms; overlap {r.comm_overlap:.2f}")
    print(f"use it with: fivefold plan --hardware {out} ...", file=sys.stdout)
    return 0


def _load_note() -> str:
    """The 1-minute load average: above the core count, other work shared the machine with the timings."""
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


