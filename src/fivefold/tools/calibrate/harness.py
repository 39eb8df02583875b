"""The timing harness of `fivefold calibrate`: synchronised timings over the ranks of a group (`Clock`), the
process groups a calibration run uses (`RankGroups`, created once per run and passed to whatever needs them),
operands rotated beyond the caches, and repeated passes that keep each shape's best figure."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

Say = Callable[[str], None]  # prints a progress line (rank 0 only)


@dataclass
class RankGroups:
    """The process groups of one calibration run on `world` ranks, created by every rank in the same order.

    `cpu`: the group that agrees on timings with CPU tensors (None: the default group, already gloo on CPU; a
    gloo group beside the accelerator's backend otherwise). `by_size`: this rank's group of each size 2..world
    that divides world (the world / size groups of consecutive ranks run at once, as a layout's groups do)."""

    world: int
    rank: int
    cpu: dist.ProcessGroup | None = None
    by_size: dict[int, dist.ProcessGroup] = field(default_factory=dict)

    @classmethod
    def single(cls) -> RankGroups:
        """One rank: no process group at all."""
        return cls(1, 0)

    @classmethod
    def create(cls, device_type: str) -> RankGroups:
        """The groups of the process group this process has joined."""
        world, rank = dist.get_world_size(), dist.get_rank()
        by_size = {}
        for size in [n for n in range(2, world + 1) if world % n == 0]:
            every = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
            by_size[size] = every[rank // size]
        cpu = None if device_type == "cpu" else dist.new_group(backend="gloo")
        return cls(world, rank, cpu, by_size)


class Clock:
    """Synchronised timings that every rank of the group runs together (same repetitions, started at a barrier),
    so that ranks sharing cores compete as in a training step."""

    def __init__(self, device: torch.device, group_size: int, min_seconds: float, sample_seconds: float = 0.0,
                 cpu_group: dist.ProcessGroup | None = None) -> None:
        self.device, self.group_size, self.min_seconds = device, group_size, min_seconds
        self.sample_seconds = sample_seconds
        self.cpu_group = cpu_group  # where ranks agree on CPU tensors (None: the default group)

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def agree(self, value: float) -> float:
        """The largest `value` over the ranks (every rank then runs as many repetitions)."""
        if self.group_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return float(t.item())

    def barrier(self) -> None:
        if self.group_size > 1:
            dist.barrier(group=self.cpu_group)

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
        once = self.agree(time.perf_counter() - t0)
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
            dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return [lower_quartile(row.tolist()) for row in samples]


def lower_quartile(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=4, method="inclusive")[0] if len(samples) > 1 else samples[0]


# Operands of a timed call are rotated through sets spanning more than the caches (a CPU's L3, a GPU's L2), so
# that every call starts from memory as in a training step, where the other layers' work has evicted them.
COLD_SPAN_BYTES = 96 * 2**20
MAX_SETS = 64


def operand_sets(set_bytes: int) -> int:
    """How many copies of operands of `set_bytes` to rotate through so that each call finds them uncached."""
    return max(1, min(MAX_SETS, math.ceil(COLD_SPAN_BYTES / max(set_bytes, 1))))


OperandSet = tuple[Callable[[], torch.Tensor], list[torch.Tensor], torch.Tensor]


def time_forward_backward(clock: Clock, make: Callable[[], OperandSet], set_bytes: int) -> tuple[float, float]:
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


def tflops(clock: Clock, make: Callable[[], OperandSet], set_bytes: int, flops: float) -> list[float]:
    """[forward, backward] TFLOP/s of a call doing `flops` forward (twice that backward), timed as
    `time_forward_backward` times it."""
    fwd, bwd = time_forward_backward(clock, make, set_bytes)
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


def size_text(nbytes: int) -> str:
    """`nbytes` for a progress line: 4 KiB, 1 MiB, 512 B."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
