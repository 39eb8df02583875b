"""A run checked against its plan: what the planner predicted for this run's layout on this device (`Expectation`,
made by the command line, which may read the planner), and the comparison the training loop makes on its logging
steps (`PlanCheck`): the measured step time against the predicted band, every rank's busy time against the others',
the peak memory against the predicted peak. Each finding is one warning line naming the likely cause, said once.

Per-rank figures come from the logging steps only, in the collective that already gathers each rank's peak memory:
the seconds since the last logging step and the seconds this rank spent waiting for its peers at the step's
synchronisation points (`WaitClock`). A rank that its peers wait for is busy longer than they are: a slow node or
device. Every rank slow alike points at the device profile instead; memory above the prediction names the part
(model states, or activations and buffers) that exceeds its share."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# the band around the predicted step time inside which no warning is given: the planner's held-out step-time error
# on the CPU loop is 17 % in the median, and a shared machine adds its own noise
BAND = (1 / 1.5, 1.5)
# a rank is slow when its busy seconds per step exceed the median of the other ranks' by this fraction and by this
# share of the step (both, so that noise on a short step and a small difference on a long one say nothing; a
# 2-core machine under load showed one rank of a normal run 37 % and a ninth of the step busier than the other)
SLOW_RANK_RATIO, SLOW_RANK_SHARE = 1.5, 0.20
# peak memory this much above the predicted peak is worth a word
MEMORY_RATIO = 1.10
# on the CPU the measured peak is the resident set above the process's baseline (the interpreter, its libraries and
# the data, measured before the model is built: `metrics.memory_baseline`), which also holds what the C allocator
# keeps of freed memory: the planner counts the live tensors exactly (the tiny model's 236 MiB at micro-batch 32,
# against the profiler's 236), but glibc's heap held 1.3-2.4x that on one process and up to 7x under tp2 + sp
# (docs/sweeps.md; with glibc's thread cache on, as in a process started by hand: `device.cpu_allocator_env` turns
# it off for the ranks fivefold starts), so the CPU's allowance is this ratio plus a margin, on the live tensors (a
# calibrated profile's `heap_retention` adds its own estimate of the cache to the prediction, `allocator_cache`,
# which the allowance leaves out)
CPU_HEAP_RATIO, CPU_HEAP_MARGIN_BYTES = 2.5, 256 * 2**20
STATE_PARTS = ("parameters", "gradients", "optimizer")  # of `planner.predict.engine_parts`


@dataclass(frozen=True)
class Expectation:
    """The planner's prediction of this run: step seconds, peak bytes per device and the peak's parts (the most
    loaded rank's; model states under `STATE_PARTS`, the rest activations and buffers), on the named profile."""

    profile: str
    step_s: float
    peak_bytes: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def band(self) -> tuple[float, float]:
        return self.step_s * BAND[0], self.step_s * BAND[1]

    def describe(self) -> str:
        lo, hi = self.band
        return (f"plan ({self.profile} profile): step {seconds(self.step_s)} (a warning outside {seconds(lo)} to "
                f"{seconds(hi)}), peak {gib(self.peak_bytes)} per device")


def seconds(s: float) -> str:
    return f"{s:.3g} s" if s < 100 else f"{s:,.0f} s"


def gib(b: float) -> str:
    return f"{b / 2**30:,.2f} GiB"


class WaitClock:
    """Seconds this rank waits for its peers at the step's synchronisation points (the data-parallel reductions,
    the gradient norm, the agreement on a step): host time on the CPU, where a collective's wait blocks the host;
    on an accelerator the time its stream stands still, from timing events around the wait, read after the logging
    step's synchronisation."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device, self.host, self.enabled = device, device.type == "cpu", enabled
        self.seconds = 0.0
        self.events: list[tuple[torch.Event, torch.Event]] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if not self.enabled:  # one device: no peers to wait for
            yield
            return
        if self.host:
            start = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - start
            return
        begin = torch.Event(device=self.device, enable_timing=True)
        begin.record()
        yield
        end = torch.Event(device=self.device, enable_timing=True)
        end.record()
        self.events.append((begin, end))

    def read(self) -> float:
        """The seconds waited since the last read (after the device is synchronised)."""
        waited = self.seconds + sum(a.elapsed_time(b) for a, b in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return waited


@dataclass
class Interval:
    """What the ranks measured between two logging steps: `steps` steps, each rank's seconds and seconds waited,
    each rank's peak memory so far and, on the CPU, its resident bytes before the model was built."""

    steps: int
    seconds: list[float]
    waited: list[float]
    peaks: list[int]
    baselines: list[int] = field(default_factory=list)


@dataclass
class PlanCheck:
    """The comparison of a run with its `Expectation`, fed one `Interval` per logging step (the first interval,
    which holds the warm-up, is measured but not judged); `warn` lines are said once per cause."""

    expected: Expectation
    device_type: str
    said: set[str] = field(default_factory=set)
    measured_steps: int = 0
    measured_seconds: float = 0.0
    intervals: int = 0
    held_states: int | None = None  # the model states this rank holds (the engine's count), when known
    # the peak the prediction describes, the largest of any rank: on the CPU the resident set above that rank's
    # baseline (its resident bytes before the model was built, `metrics.memory_baseline`; 0 on an accelerator)
    measured_peak: int = 0
    baseline: int = 0

    def observe(self, interval: Interval) -> list[str]:
        self.intervals += 1
        for peak, baseline in zip(interval.peaks, interval.baselines or [0] * len(interval.peaks), strict=True):
            if peak - baseline > self.measured_peak:
                self.measured_peak, self.baseline = peak - baseline, baseline
        if self.intervals == 1 or interval.steps == 0:
            return []
        self.measured_steps += interval.steps
        self.measured_seconds += max(interval.seconds)
        lines = [self.slow_rank(interval), self.slow_device(interval), self.memory()]
        out = []
        for cause, line in (x for x in lines if x is not None):
            if cause not in self.said:
                self.said.add(cause)
                out.append(line)
        return out

    def step_s(self, interval: Interval) -> float:
        return max(interval.seconds) / interval.steps

    def slow_rank(self, interval: Interval) -> tuple[str, str] | None:
        """The rank the others wait for, when its busy time per step stands out from the median of the others'."""
        if len(interval.seconds) < 2:
            return None
        busy = [(s - w) / interval.steps for s, w in zip(interval.seconds, interval.waited, strict=True)]
        rank = max(range(len(busy)), key=busy.__getitem__)
        median = statistics.median(busy[:rank] + busy[rank + 1:])  # of the others
        step = self.step_s(interval)
        if busy[rank] > SLOW_RANK_RATIO * median and busy[rank] - median > SLOW_RANK_SHARE * step:
            waited = statistics.median(interval.waited[:rank] + interval.waited[rank + 1:]) / interval.steps
            return "slow rank", (f"rank {rank} is slower than the others: busy {seconds(busy[rank])} per step against "
                                 f"a median {seconds(median)} of the others, which wait {seconds(waited)} per step "
                                 f"for its peers; a slow node or device (check rank {rank}'s host: load, thermal "
                                 "throttling, a degraded link)")
        return None

    def slow_device(self, interval: Interval) -> tuple[str, str] | None:
        """Every rank off the predicted band alike: the device profile does not describe this machine."""
        step = self.step_s(interval)
        lo, hi = self.expected.band
        if lo <= step <= hi:
            return None
        how = "slower" if step > hi else "faster"
        return f"device {how}", (
            f"step {seconds(step)} measured against {seconds(self.expected.step_s)} predicted "
            f"({100 * (step / self.expected.step_s - 1):+.0f} %), every rank {how} alike: the "
            f"{self.expected.profile} profile does not describe this machine (`fivefold calibrate --out FILE` measures "
            "one, and `fivefold train --hardware FILE` checks a run against it; "
            "other work on the machine slows every rank too)")

    def memory(self) -> tuple[str, str] | None:
        """Peak memory above the prediction, and which part exceeds its share."""
        e, peak, cpu = self.expected, self.measured_peak, self.device_type == "cpu"
        live = e.peak_bytes - e.parts.get("allocator_cache", 0.0)
        if peak <= (CPU_HEAP_RATIO * live + CPU_HEAP_MARGIN_BYTES if cpu else MEMORY_RATIO * e.peak_bytes):
            return None
        states = sum(v for k, v in e.parts.items() if k in STATE_PARTS)
        excess = peak - e.peak_bytes
        if self.held_states is not None and self.held_states - states > excess / 2:
            where = (f"the model states: {gib(self.held_states)} held against {gib(states)} predicted (parameters, "
                     "gradients, optimizer)")
        else:
            where = (f"activations and buffers: {gib(peak - (self.held_states or states))} against "
                     f"{gib(e.peak_bytes - states)} predicted")
        return "memory", (f"peak memory {gib(peak)} measured{self.above_baseline()} against {gib(e.peak_bytes)} "
                          f"predicted ({100 * (peak / e.peak_bytes - 1):+.0f} %); the excess is in {where}"
                          + ("; on the CPU the C allocator also keeps freed memory" if cpu else ""))

    def above_baseline(self) -> str:
        return f" above the process's {gib(self.baseline)} before the model was built" if self.baseline else ""

    def summary(self) -> str | None:
        """Predicted beside measured, for the end of the run (None before any judged interval)."""
        if not self.measured_steps:
            return None
        step = self.measured_seconds / self.measured_steps
        e = self.expected
        return (f"plan vs measured ({e.profile} profile): step {seconds(e.step_s)} predicted, {seconds(step)} "
                f"measured ({100 * (step / e.step_s - 1):+.0f} %); peak {gib(e.peak_bytes)} predicted, "
                f"{gib(self.measured_peak)} measured{self.above_baseline()}")


SLOW_RANK_ENV = "FIVEFOLD_TEST_SLOW_RANK"


def injected_delay(rank: int) -> float:
    """Tests only: the seconds rank `rank` sleeps before each step's forward when `FIVEFOLD_TEST_SLOW_RANK` is
    `RANK:SECONDS` (a slow node, made on purpose); 0 otherwise."""
    value = os.environ.get(SLOW_RANK_ENV, "")
    if not value:
        return 0.0
    slow, _, delay = value.partition(":")
    return float(delay) if int(slow) == rank else 0.0
