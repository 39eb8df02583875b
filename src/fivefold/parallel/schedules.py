"""Pipeline schedules as data: the ordered actions each pipeline rank runs, and a simulator of them.

A schedule is a list per rank of `Action(kind, micro_batch, stage)`:

* `kind` is `"F"` (forward), `"B"` (backward) or `"W"` (weight-gradient pass). In schedules whose
  `split_backward` is False, `"B"` is the whole backward; in the zero-bubble family it computes only the
  gradient with respect to the stage's input, and `"W"` later computes the weight gradients.
* `micro_batch` counts from 0 to m - 1.
* `stage` is the global model chunk, 0 .. p * v - 1, in model order; `Schedule.stage_rank[stage]` is the
  rank that holds it. 1F1B and AFAB have one stage per rank (stage = rank); interleaved 1F1B gives rank r the
  stages r, r + p, r + 2p, ...; the V-shaped schedules (DualPipeV) give rank r the stages r and 2p - 1 - r.

The pipeline engine runs these lists; the planner simulates the same lists with `simulate` to get the step's
makespan, the bubble and the peak number of micro-batches whose activations a rank holds. Nothing here
touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from fivefold.config import shown
from fivefold.layout import SCHEDULES, min_micro_batches

Kind = Literal["F", "B", "W"]
# the schedules whose backward is split into B (input gradient) and W (weight gradient): their W passes hold memory
SPLIT_BACKWARD = ("zero-bubble", "dualpipev")


class Action(NamedTuple):
    kind: Kind
    micro_batch: int
    stage: int


@dataclass(frozen=True)
class Schedule:
    name: str
    p: int  # pipeline ranks
    m: int  # micro-batches per step
    v: int  # stages (model chunks) per rank
    actions: tuple[tuple[Action, ...], ...]  # per rank, in execution order
    stage_rank: tuple[int, ...]  # global stage -> rank
    split_backward: bool  # True when backward is split into B (input gradient) and W (weight gradient)
    # per rank, the indices k whose F runs together with the B at k + 1, on the rank's other chunk, and with that
    # B's W where it comes next (DualPipeV's overlapped forward and backward, `fused_pairs`, `unit`): all start once
    # both inputs have arrived, and both outputs leave when all have ended
    fused: tuple[tuple[int, ...], ...] = ()
    pair_w: bool = False  # a fused pair's backward lane runs its W too, where W comes next (`unit`)

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def fused_at(self, rank: int) -> frozenset[int]:
        """The indices of `rank`'s actions whose F runs fused with the B that follows it (none if not fused)."""
        return frozenset(self.fused[rank]) if self.fused else frozenset()

    def unit(self, rank: int, k: int, fused: frozenset[int] | None = None) -> tuple[Action, ...]:
        """The actions of `rank` that run as one unit from index k: a fused pair's F and B, with the B's own W
        where `pair_w` and W is the next action (DualPipe overlaps a forward with a whole backward: both halves of
        the backward run in the pair's second lane), or the action alone. `fused`: `fused_at(rank)`, if at hand."""
        acts = self.actions[rank]
        if k not in (self.fused_at(rank) if fused is None else fused):
            return acts[k:k + 1]
        b = acts[k + 1]
        whole = self.pair_w and k + 2 < len(acts) and acts[k + 2] == Action("W", b.micro_batch, b.stage)
        return acts[k:k + 3] if whole else acts[k:k + 2]


class ScheduleError(ValueError):
    """A schedule that cannot be built for these (p, m, v); the message says what would work."""


def build_schedule(name: str, p: int, m: int, v: int = 1, overlap_fb: bool = False, pair_w: bool = False
                   ) -> Schedule:
    """The named schedule for p ranks and m micro-batches (v stages per rank for `interleaved`); `overlap_fb`:
    DualPipeV's forward and backward of two micro-batches run together (`fused_pairs`), with the backward's W pass
    too under `pair_w` (`Schedule.unit`)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"layout.schedule = {shown(name)} is not known; choose one of: {', '.join(SCHEDULES)}")
    if p < 1 or m < 1:
        raise ScheduleError(f"a pipeline needs p >= 1 and m >= 1 micro-batches, got p = {p}, m = {m}")
    if name != "interleaved" and v != 1:
        raise ScheduleError(f"layout.vpp = {v} applies to the interleaved schedule only; use vpp = 1 with {name}")
    need = min_micro_batches(name, p, v)
    if m < need:
        raise ScheduleError(f"schedule {name} with pp = {p} needs at least {need} micro-batches, got {m}; "
                            f"raise the gradient accumulation or lower pp")
    if name == "dualpipev" and overlap_fb:
        return _fused_dualpipev(p, m, pair_w)
    return _built(name, p, m, v)


@functools.lru_cache(maxsize=8)  # a pp of 32 with 1,024 micro-batches holds about 200,000 actions
def _built(name: str, p: int, m: int, v: int) -> Schedule:
    """The named schedule's action lists (checked by `build_schedule`), built once: the planner asks for the same
    (p, m) for many layouts, and a schedule is immutable."""
    if name == "afab":
        return _afab(p, m)
    if name == "1f1b":
        return _one_f_one_b(p, m)
    if name == "interleaved":
        return _interleaved(p, m, v)
    if name == "zero-bubble":
        return _zero_bubble_h1(p, m)
    return _dualpipev(p, m)


@functools.lru_cache(maxsize=8)
def _fused_dualpipev(p: int, m: int, pair_w: bool) -> Schedule:
    schedule = _built("dualpipev", p, m, 1)
    return dataclasses.replace(schedule, fused=fused_pairs(schedule), pair_w=pair_w)


def fused_pairs(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per rank, the indices k where an F is followed by a B of the rank's other chunk: DualPipeV's F0B1 and
    F1B0 pairs, whose forward and backward (with the B's W where it comes next, `Schedule.unit`) the executor runs
    as two lanes (`lanes.run_pair`), one's collectives under the other's compute, as DeepSeek's DualPipe overlaps
    them."""
    out = []
    for acts in schedule.actions:
        ks, k = [], 0
        while k + 1 < len(acts):
            a, b = acts[k], acts[k + 1]
            if a.kind == "F" and b.kind == "B" and a.stage != b.stage:
                ks.append(k)
                k += 2
            else:
                k += 1
        out.append(tuple(ks))
    return tuple(out)


def stage_placement(name: str, p: int, v: int = 1) -> tuple[int, ...]:
    """Global stage -> the rank that holds it: one stage per rank, rank r holding r, r + p, ... (interleaved), or
    r and 2p - 1 - r (the V shape of DualPipeV)."""
    if name == "dualpipev":
        return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return tuple(s % p for s in range(p * (v if name == "interleaved" else 1)))


def forward_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Forward passes only (evaluation), with the stage placement of schedule `name`, for any m >= 1: each rank
    runs the forwards of its stages in (micro-batch, stage) order. Every dependency of an action is smaller in
    that order, so the lists cannot deadlock."""
    placement = stage_placement(name, p, v)
    actions = tuple(tuple(Action("F", i, s) for i in range(m) for s in range(len(placement)) if placement[s] == r)
                    for r in range(p))
    return Schedule(name, p, m, len(placement) // p, actions, placement, False)


def _afab(p: int, m: int) -> Schedule:
    actions = tuple(
        tuple([Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]) for r in range(p)
    )
    return Schedule("afab", p, m, 1, actions, tuple(range(p)), False)


def _one_f_one_b(p: int, m: int) -> Schedule:
    per_rank = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            acts += [Action("F", warmup + i, r), Action("B", i, r)]
        acts += [Action("B", i, r) for i in range(m - warmup, m)]
        per_rank.append(tuple(acts))
    return Schedule("1f1b", p, m, 1, tuple(per_rank), tuple(range(p)), False)


def _interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: micro-batches advance in groups of p through the rank's v chunks."""
    if m % p:
        raise ScheduleError(f"the interleaved schedule needs the micro-batch count to be a multiple of pp = {p}, "
                            f"got {m}; nearest valid counts: {sorted({max(p, m // p * p), m // p * p + p})}")
    total = m * v

    def fwd(k: int, r: int) -> Action:
        chunk = (k // p) % v
        return Action("F", (k // (p * v)) * p + k % p, chunk * p + r)

    def bwd(k: int, r: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action("B", (k // (p * v)) * p + k % p, chunk * p + r)

    per_rank = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [fwd(k, r) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(warmup + k, r), bwd(k, r)]
        acts += [bwd(k, r) for k in range(total - warmup, total)]
        per_rank.append(tuple(acts))
    return Schedule("interleaved", p, m, v, tuple(per_rank), stage_placement("interleaved", p, v), False)


def _zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): the backward split into B and W, at 1F1B's peak memory. Rank r runs 1F1B's
    warm-up (p - r forwards), then per micro-batch i its B, the W of micro-batch i - r (the first r W passes
    wait, filling the bubbles that 1F1B leaves), and the next F; the r W passes left run at the end. Rank r holds
    at most p - r micro-batches between F and B and r pending W passes (each keeps its linears' inputs and output
    gradients): p micro-batches from F to W, 1F1B's first rank's count, whatever m. The bubble is
    (p - 1)(F + B - W), a third of 1F1B's with equal F, B and W."""
    per_rank: list[tuple[Action, ...]] = []
    for r in range(p):
        acts = [Action("F", i, r) for i in range(min(p - r, m))]
        next_f, next_w = len(acts), 0
        for i in range(m):
            acts.append(Action("B", i, r))
            if i >= r:
                acts.append(Action("W", next_w, r))
                next_w += 1
            if next_f < m:
                acts.append(Action("F", next_f, r))
                next_f += 1
        acts += [Action("W", i, r) for i in range(next_w, m)]
        per_rank.append(tuple(acts))
    return Schedule("zero-bubble", p, m, 1, tuple(per_rank), tuple(range(p)), True)


def _dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek, the V-shaped half of DualPipe): rank r holds stage r (chunk 0) and stage 2p-1-r
    (chunk 1), so the first rank also computes the last stage. The eight phases of the reference
    implementation: F0 warm-up, F0F1, B1W1F1, the main F0B1F1B0 phase, B1F1B0, B1B0 (second half split),
    WB0, and the remaining W. A full backward is written as B immediately followed by its W."""
    actions = tuple(_dualpipev_rank(p, m, r) for r in range(p))
    return Schedule("dualpipev", p, m, 2, actions, stage_placement("dualpipev", p), True)


def _dualpipev_rank(p: int, m: int, r: int) -> tuple[Action, ...]:
    stages = (r, 2 * p - 1 - r)
    acts: list[Action] = []
    next_f, next_b = [0, 0], [0, 0]  # per chunk: the next micro-batch of its forward and of its backward
    w_queue: deque[Action] = deque()

    def f(c: int) -> None:
        acts.append(Action("F", next_f[c], stages[c]))
        next_f[c] += 1

    def b(c: int, split: bool) -> None:
        mb = next_b[c]
        next_b[c] += 1
        acts.append(Action("B", mb, stages[c]))
        if split:
            w_queue.append(Action("W", mb, stages[c]))
        else:
            acts.append(Action("W", mb, stages[c]))

    def w() -> None:
        acts.append(w_queue.popleft())

    for _ in range((p - r - 1) * 2):  # 1: nF0
        f(0)
    for _ in range(r + 1):  # 2: nF0F1
        f(0)
        f(1)
    for _ in range(p - r - 1):  # 3: nB1W1F1
        b(1, True)
        w()
        f(1)
    for _ in range(m - 2 * p + r + 1):  # 4: nF0B1F1B0 (the reference overlaps F with B here)
        f(0)
        b(1, False)
        f(1)
        b(0, False)
    for _ in range(p - r - 1):  # 5: nB1F1B0
        b(1, False)
        f(1)
        b(0, False)
    step6 = r + 1
    split = False
    for i in range(step6):  # 6: nB1B0, the second half with split backward
        if i == step6 // 2 and r % 2 == 1:
            split = True
        b(1, split)
        if i == step6 // 2 and r % 2 == 0:
            split = True
        b(0, split)
    for _ in range(p - r - 1):  # 7: nWB0
        w()
        b(0, True)
    while w_queue:  # 8: nW
        w()
    return tuple(acts)


# ---------------------------------------------------------------------------------------------
# Simulation


@dataclass(frozen=True)
class SimResult:
    makespan: float  # time from the first forward to the last action of any rank
    busy: tuple[float, ...]  # compute time per rank
    bubble: float  # (makespan - busiest rank's compute) / busiest rank's compute: the playbook's ratio r
    idle_fraction: float  # share of the makespan the busiest rank waits
    start: dict[tuple[str, int, int], float]  # (kind, micro-batch, stage) -> start time
    end: dict[tuple[str, int, int], float]
    schedule: Schedule = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def peak_in_flight(self) -> tuple[float, ...]:
        """Per rank: most micro-batches with activations held, in stage units (counted when asked: the planner's
        makespan does not need it)."""
        return _peak_in_flight(self.schedule)


def _per_stage(value: float | Sequence[float], n: int) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * n
    if len(value) != n:
        raise ValueError(f"need one time per stage ({n}), got {len(value)}")
    return [float(x) for x in value]


def simulate(schedule: Schedule, t_f: float | Sequence[float], t_b: float | Sequence[float],
             t_w: float | Sequence[float] = 0.0, p2p: float = 0.0,
             pair_seconds: Callable[..., float] | None = None,
             t_after_send: float | Sequence[float] = 0.0) -> SimResult:
    """Run the per-rank action lists against their dependencies and return the timing.

    `t_f`, `t_b`, `t_w` are the times of one micro-batch's forward, input-gradient backward and weight-gradient
    pass of each stage (a number for all stages, or one per global stage). When the schedule does not split
    the backward, its B takes t_b + t_w. `p2p` is the time to send activations (or their gradients) to the
    neighbouring stage when it lives on another rank. Dependencies: F(i, s) after F(i, s-1); B(i, s) after
    B(i, s+1) (the last stage after its own F); W(i, s) after B(i, s); each rank runs its list in order. A fused
    pair (`Schedule.unit`: F and B, and the B's W where it comes next) starts once both its inputs are in and takes
    `pair_seconds(F, B)` or `pair_seconds(F, B, W)` (default: the sum of its actions); both its outputs leave at
    its end. `t_after_send` (per stage; schedules that do not split the backward): the part of each B that runs
    after its input gradient has left for the previous stage (the first block's weight gradients, which
    `layout.pp_comm_overlap` defers past the send): the previous stage may start that much before the B ends.
    """
    n = schedule.n_stages
    tf, tb, tw = _per_stage(t_f, n), _per_stage(t_b, n), _per_stage(t_w, n)
    early = [0.0] * n
    if not schedule.split_backward:
        tb = [b + w for b, w in zip(tb, tw, strict=True)]
        early = [min(e, b) for e, b in zip(_per_stage(t_after_send, n), tb, strict=True)]
    dur = {"F": tf, "B": tb, "W": tw}
    sr = schedule.stage_rank
    end: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * schedule.p
    pos = [0] * schedule.p
    remaining = sum(len(a) for a in schedule.actions)
    busy = [0.0] * schedule.p  # compute time per rank (a fused pair counted as it runs)
    fused = [schedule.fused_at(r) for r in range(schedule.p)]

    def ready(a: Action) -> float | None:
        s = a.stage
        if a.kind == "F":
            if s == 0:
                return 0.0
            dep, cross = ("F", a.micro_batch, s - 1), sr[s - 1] != sr[s]
        elif a.kind == "B":
            if s == n - 1:
                dep, cross = ("F", a.micro_batch, s), False
            else:
                dep, cross = ("B", a.micro_batch, s + 1), sr[s + 1] != sr[s]
                t = end.get(dep)
                return None if t is None else t - early[s + 1] + (p2p if cross else 0.0)
        else:
            dep, cross = ("B", a.micro_batch, s), False
        t = end.get(dep)
        if t is None:
            return None
        return t + (p2p if cross else 0.0)

    while remaining:
        progressed = False
        for r in range(schedule.p):
            acts, fused_r = schedule.actions[r], fused[r]
            while pos[r] < len(acts):
                if pos[r] not in fused_r:  # one action, the common case (no unit built: the planner's hot loop)
                    group, t = acts[pos[r]:pos[r] + 1], ready(acts[pos[r]])
                    if t is None:
                        break
                    begin = max(clock[r], t)
                    took = dur[group[0].kind][group[0].stage]
                else:  # a fused pair (F, B, and the B's W) starts when both inputs are in, and both outputs leave
                    # when all have ended
                    group = schedule.unit(r, pos[r], fused_r)
                    times = [ready(a) for a in group if a.kind != "W"]  # a pair's W: after its B
                    if any(t is None for t in times):
                        break
                    begin = max(clock[r], *times)
                    took = pair_seconds(*group) if pair_seconds is not None else \
                        sum(dur[a.kind][a.stage] for a in group)
                clock[r] = begin + took
                busy[r] += clock[r] - begin
                for a in group:  # keyed by the action itself, equal to its (kind, micro-batch, stage)
                    start[a], end[a] = begin, clock[r]
                pos[r] += len(group)
                remaining -= len(group)
                progressed = True
        if not progressed:
            stuck = [schedule.actions[r][pos[r]] for r in range(schedule.p) if pos[r] < len(schedule.actions[r])]
            raise ScheduleError(f"schedule {schedule.name} deadlocks; waiting actions: {stuck}")
    makespan = max(end.values()) - min(start.values())
    top = max(busy)
    return SimResult(makespan, tuple(busy), (makespan - top) / top if top else 0.0,
                     (makespan - top) / makespan if makespan else 0.0, start, end, schedule)


def _holdings(schedule: Schedule) -> list[set[tuple[float, float]]]:
    """Per rank, the (stage activations, pending W passes) it holds after each of its actions, in whole-stage
    units (a chunk of an interleaved or V schedule holds 1/v of a stage's layers): an F holds activations until
    its B; under a split backward the B hands the micro-batch to its W, which keeps the linear layers' inputs and
    output gradients until it runs."""
    out = []
    for acts in schedule.actions:
        held = pending = 0
        points = set()
        for a in acts:
            if a.kind == "F":
                held += 1
            elif a.kind == "B":
                held -= 1
                pending += schedule.split_backward
            else:
                pending -= 1
            points.add((held / schedule.v, pending / schedule.v))
        out.append(points)
    return out


def _peak_in_flight(schedule: Schedule) -> tuple[float, ...]:
    """Per rank, the most micro-batch activations held at once, counted in whole-stage units (a chunk of an
    interleaved or V schedule holds 1/v of a stage's layers). Activations are held from F until B; a pending
    W keeps only the inputs of the linear layers, which are not counted here."""
    return tuple(max(a for a, _ in points) for points in _holdings(schedule))


@functools.lru_cache(maxsize=512)
def held_points(name: str, p: int, m: int, v: int = 1) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per rank, `_holdings` of the schedule reduced to the pairs that no other pair exceeds in both. A memory
    model weighs activations against pending W passes (`planner.memory`) and takes the largest."""
    return tuple(tuple(sorted(x for x in points if not any(y != x and y[0] >= x[0] and y[1] >= x[1] for y in points)))
                 for points in _holdings(build_schedule(name, p, m, v)))


def closed_form_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The playbook's bubble ratio for equal stages, t_b = 2 t_f and no W split: (p-1)/m, or (p-1)/(v m)."""
    return (p - 1) / (v * m) if name == "interleaved" else (p - 1) / m


def render(schedule: Schedule, sim: SimResult | None = None) -> str:
    """One text line per rank: the actions in order, e.g. `F0 F1 B0 ...` (stage suffix `.s` when v > 1)."""
    lines = []
    for r, acts in enumerate(schedule.actions):
        cells = [f"{a.kind}{a.micro_batch}" + (f".{a.stage}" if schedule.v > 1 else "") for a in acts]
        lines.append(f"rank {r}: " + " ".join(cells))
    if sim is not None:
        lines.append(f"makespan {sim.makespan:.3g}, bubble {sim.bubble:.3f}")
    return "\n".join(lines)


def timeline(schedule: Schedule) -> str:
    """The schedule drawn against time, one text line per rank, as `simulate` runs it with equal chunks: one
    column is one chunk's forward of one micro-batch (t_f = 1), a backward takes 2 (B 1 and W 1 when split,
    else one B of 2), a transfer 0. A cell is the action's kind and micro-batch (`F3`), lower case for a rank's
    second chunk (interleaved, DualPipeV), `..` for idle."""
    sim = simulate(schedule, 1.0, 1.0, 1.0)
    width = round(sim.makespan)
    lines = []
    for r, acts in enumerate(schedule.actions):
        mine = sorted({a.stage for a in acts})
        cells = [".."] * width
        for a in acts:
            key = (a.kind, a.micro_batch, a.stage)
            label = f"{a.kind}{a.micro_batch}"
            if mine.index(a.stage) == 1:
                label = label.lower()
            for t in range(round(sim.start[key]), round(sim.end[key])):
                cells[t] = label
        lines.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(lines)

