"""Estimate one layout, and search every layout that reaches the global batch exactly.

The search enumerates tp (inside a node), cp, pp, dp (the rest of the devices), ep (MoE) and for MoE under tp
the expert tensor parallel degree etp (1: whole experts, or tp), the micro-batch
size (the gradient accumulation follows), ZeRO 0-3, recompute, sequence parallel, and the pipeline schedule
with its virtual stages. Cheap pruning: divisibility first, then memory (recompute only lowers memory, so a
family whose full-recompute variant does not fit is dropped whole); every survivor is timed with the closed-form
pipeline bubble, and the best few are re-timed by simulating their schedule's action list.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from dataclasses import dataclass, field

from fivefold.config import ModelConfig, divisors, shown
from fivefold.errors import CliError
from fivefold.flops import (
    DocumentLengths,
    attention_fraction,
    causal_equivalent,
    training_flops_per_token,
)
from fivefold.layout import (
    batch_problem,
    hsdp_problem,
    layout_problem,
    pipeline_problem,
    sequence_length_problem,
    tensor_parallel_problem,
)
from fivefold.parallel.schedules import held_points
from fivefold.planner.hardware import Cluster
from fivefold.planner.layout import Framework, Layout
from fivefold.planner.memory import GIB, rank_memory, splits_backward, with_heap_retention
from fivefold.planner.time import StallRisk, stage_split_problem, stall_risk, step_time

SIMULATED_TOP = 64


def in_flight(schedule: str, p: int, m: int, v: int) -> tuple[float, float]:
    """Micro-batches of stage activations held by the first and the last pipeline rank at their peak: the
    closed forms of the schedules' action lists (tests/test_planner.py checks them against the lists)."""
    if p == 1:
        return 1.0, 1.0
    if schedule == "afab":
        return float(m), float(m)
    if schedule == "interleaved":
        return min(2 * (p - 1) + (v - 1) * p + 1, m * v) / v, min((v - 1) * p + 1, m * v) / v
    if schedule == "dualpipev":
        return p + 0.5, p + 0.5
    return float(min(p, m)), 1.0  # 1f1b and zero-bubble


@dataclass
class Estimate:
    layout: Layout
    fits: bool
    memory: dict[str, dict[str, float]]  # "first"/"last" pipeline rank -> part -> bytes
    peak_bytes: float
    step_time_s: float
    time_parts: dict[str, float]
    tokens_per_s_per_device: float
    mfu: float  # the attention the model's mask executes counted (`fivefold.flops.training_flops_per_token`)
    notes: list[str] = field(default_factory=list)
    # under a document mask or a sliding window: the share of causal attention's pairs executed, and the MFU that
    # counts plain causal attention instead (None without a mask)
    attention_pairs_fraction: float | None = None
    mfu_causal_equivalent: float | None = None
    stall: StallRisk = field(default_factory=StallRisk)  # the cluster's risk for this layout (`time.stall_risk`)

    @property
    def peak_rank(self) -> tuple[str, dict[str, float]]:
        """("first" or "last", its memory by part) of the pipeline rank with the largest peak."""
        return max(self.memory.items(), key=lambda item: sum(item[1].values()))

    def step_time_at(self, quantile: float) -> float:
        """The step time at this quantile (0.5: typical, p50; 0.9: a bad case, p90) of the stall model."""
        return self.stall.quantile(self.step_time_s, quantile)

    @property
    def expected_step_time_s(self) -> float:
        return self.stall.expected(self.step_time_s)

    def tokens_per_s_at(self, step_time_s: float) -> float:
        """Tokens/s per device at another step time of the same layout."""
        if step_time_s == self.step_time_s:
            return self.tokens_per_s_per_device
        return self.tokens_per_s_per_device * self.step_time_s / step_time_s

    def risk_json(self) -> dict:
        """p50, p90 and expected step time and tokens/s per device, and the stall risk (`plan --json`)."""
        p50, p90 = self.step_time_at(0.5), self.step_time_at(0.9)
        return {"step_time_p50_s": p50, "step_time_p90_s": p90, "expected_step_time_s": self.expected_step_time_s,
                "tokens_per_s_per_device_p50": self.tokens_per_s_at(p50),
                "tokens_per_s_per_device_p90": self.tokens_per_s_at(p90),
                "stall_risk": self.stall.probability, "stall_added_s": self.stall.added_s}

    def to_json(self) -> dict:
        masked = {} if self.attention_pairs_fraction is None else {
            "attention_pairs_fraction": self.attention_pairs_fraction,
            "mfu_causal_equivalent": self.mfu_causal_equivalent}
        return {
            "layout": self.layout.to_dict(),
            "fits": self.fits,
            "memory_bytes": {"peak": self.peak_bytes, **{k: dict(v, peak=sum(v.values()))
                                                          for k, v in self.memory.items()}},
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_device,  # the previous name, for one release
            "mfu": self.mfu,
            **masked,
            "time_s": {"step": self.step_time_s, **self.time_parts},
            **self.risk_json(),
        }


# how the search ranks layouts (`plan --rank`): by the expected step time (the clean time plus the stall risk
# times what a stall adds), or by the p90 step time for the risk-averse; both equal the clean time on a cluster
# without stall data
RANK_RULES = {"expected": lambda e: e.expected_step_time_s, "p90": lambda e: e.step_time_at(0.9)}


def rank_key(rule: str) -> Callable[[Estimate], float]:
    """Sort key (smaller first) of a rank rule: minus the tokens/s per device at the rule's step time."""
    if rule not in RANK_RULES:
        raise CliError(f"--rank {rule!r} is not a rank rule; use one of: {', '.join(RANK_RULES)}")
    time_of = RANK_RULES[rule]
    return lambda e: -e.tokens_per_s_at(time_of(e))


def memory_of(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, moe_imbalance: float = 1.0
              ) -> dict[str, dict[str, float]]:
    first, last = in_flight(lay.schedule, lay.pp, lay.grad_accum_steps, lay.vpp)
    held: tuple[tuple[tuple[float, float], ...], ...] = ((), ())
    if splits_backward(lay):  # pending W passes hold memory beside the activations
        points = held_points(lay.schedule, lay.pp, lay.grad_accum_steps, lay.vpp)
        held = (points[0], points[-1])
    out = {"first": rank_memory(cfg, seq, lay, fw, first, "first", moe_imbalance, held[0]).parts}
    if lay.pp > 1:
        out["last"] = rank_memory(cfg, seq, lay, fw, last, "last", moe_imbalance, held[1]).parts
    return out


def estimate(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, hw: Cluster, exact: bool = True,
             memory_limit: float | None = None, moe_imbalance: float = 1.0,
             docs: DocumentLengths | None = None, mem: dict[str, dict[str, float]] | None = None) -> Estimate:
    """One layout's memory, step time and MFU; `docs`: the documents' lengths under the model's document mask;
    `mem`: the layout's `memory_of`, where the caller has it."""
    mem = with_heap_retention(memory_of(cfg, seq, lay, fw, moe_imbalance) if mem is None else mem, hw.heap_retention)
    peak = max(sum(v.values()) for v in mem.values())
    limit = hw.memory_bytes * fw.usable_memory_fraction if memory_limit is None else memory_limit
    t = step_time(cfg, seq, lay, fw, hw, exact, docs, moe_imbalance)
    tokens = lay.dp * lay.micro_batch_size * lay.grad_accum_steps * seq
    n = lay.world_size
    tps = tokens / t.step_time / n
    # the peak of a rank as the step time sees it (a calibrated profile's fields measured with that many ranks)
    peak_flops = hw.on_node(min(lay.world_size, hw.gpus_per_node)).peak_flops(fw.compute_dtype)
    mfu = tps * training_flops_per_token(cfg, seq, docs=docs) / peak_flops
    notes = [f"pp = {lay.pp} exceeds the {cfg.n_layers} layers"] if lay.pp > cfg.n_layers else []
    split = stage_split_problem(cfg, lay, fw)
    if split:
        notes.append(split)
    e = Estimate(lay, peak <= limit and not notes, mem, peak, t.step_time, t.parts, tps, mfu, notes,
                 stall=stall_risk(lay, hw))
    if cfg.masks_attention:
        e.attention_pairs_fraction = attention_fraction(cfg, seq, docs)
        e.mfu_causal_equivalent = tps * training_flops_per_token(causal_equivalent(cfg), seq) / peak_flops
    return e


# ---------------------------------------------------------------------------------------------
# Search


@dataclass
class SearchSpace:
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sp: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = ("afab", "1f1b", "interleaved", "zero-bubble", "dualpipev")
    vpp: tuple[int, ...] = (2, 4)
    max_mbs: int = 64
    max_tp: int = 0  # 0 = the GPUs per node
    cp: bool = True
    fp32_grad_accum: bool | None = None  # None: the framework's default (`Framework.default_fp32_grad_accum`)
    hsdp: bool = True  # try HSDP (one node's ranks per shard group) where the framework runs it (`Framework.hsdp`)
    # degrees held at one value (`plan --fix`): (name, value) for dp, tp, pp, cp, ep, micro_batch_size
    fixed: tuple[tuple[str, int], ...] = ()

    def allows(self, name: str, value: int) -> bool:
        return all(v == value for k, v in self.fixed if k == name)


@dataclass
class SearchResult:
    candidates: list[Estimate]  # fitting layouts, best first
    rejected: Counter  # reason -> layouts
    examples: dict[str, str]  # reason -> one example layout
    evaluated: int
    closest_misfit: Estimate | None = None


def search(cfg: ModelConfig, seq: int, global_batch_seqs: int, n_gpus: int, fw: Framework, hw: Cluster,
           space: SearchSpace | None = None, top: int = 10, moe_imbalance: float = 1.0,
           docs: DocumentLengths | None = None, rank: str = "expected",
           progress: Callable[[int, int], None] | None = None, pool: SearchPool | None = None) -> SearchResult:
    """Every layout of the space; the fitting ones best first by the rank rule (`RANK_RULES`). `progress`: called
    once the layouts are enumerated, with their number and the processes that judge them (`search_workers`).
    `pool`: the processes of a series of searches (`plan scaling`), kept open by the caller; else the search
    starts its own where it needs processes and ends them when it returns."""
    key = rank_key(rank)
    space = space or SearchSpace()
    if space.fp32_grad_accum is None:
        space = dataclasses.replace(space, fp32_grad_accum=fw.default_fp32_grad_accum)
    rejected: Counter = Counter()
    examples: dict[str, str] = {}

    def reject(reason: str, example: str, count: int = 1) -> None:
        rejected[reason] += count
        examples.setdefault(reason, example)

    hsdp_ranks = hw.gpus_per_node if space.hsdp and fw.hsdp else 0
    bases = list(_bases(cfg, seq, global_batch_seqs, n_gpus, hw, space, reject, hsdp_ranks))
    job = _Job(cfg, seq, fw, hw, space.recompute, moe_imbalance, docs)
    fitting: list[Estimate] = []
    closest: tuple[float, Layout] | None = None
    with nullcontext(pool) if pool is not None else SearchPool() as pool:
        workers = pool.start(job, search_workers(len(bases)))
        if progress is not None:
            progress(len(bases), workers)
        for judged in pool.map(_judge, bases, group=lambda lay: (lay.pp, lay.grad_accum_steps, lay.schedule)):
            if judged.misfit_peak is not None:  # not even full recompute fits
                reject("does not fit in memory even with full recompute", judged.base.short(), len(space.recompute))
                if closest is None or judged.misfit_peak < closest[0]:
                    closest = (judged.misfit_peak, judged.base)
                continue
            for short in judged.need_recompute:
                reject("does not fit in memory without (more) recompute", short)
            fitting.extend(judged.fitting)
        fitting.sort(key=key)
        best = pool.map(_simulate, fitting[:SIMULATED_TOP])
    best.sort(key=key)
    evaluated = len(bases)
    closest_estimate = None if closest is None else estimate(
        cfg, seq, closest[1], fw, hw, False, moe_imbalance=moe_imbalance, docs=docs)
    # top = 0: every fitting candidate, the best SIMULATED_TOP simulated and the rest with the closed form
    candidates = best[:top] if top else best + fitting[SIMULATED_TOP:]
    return SearchResult(candidates, rejected, examples, evaluated, closest_estimate)


# ---------------------------------------------------------------------------------------------
# Judging the layouts, in this process or in a pool of processes

# a search of this many layouts (each tried with every recompute mode) or more runs in a pool of processes, one per
# CPU core up to MAX_WORKERS (`search_workers`): about 1 ms per layout, so from about 4 s of work. Each process
# imports the planner (without torch: tests/test_architecture.py) and builds the schedules of the pipeline shapes it
# is given; the calling process's own share (listing the layouts, sorting what comes back) bounds what more
# processes could save. FIVEFOLD_PLAN_WORKERS sets the count
PARALLEL_MIN_LAYOUTS = 4096
MAX_WORKERS = 8


def search_workers(n_layouts: int) -> int:
    """Processes to judge `n_layouts` layouts with: FIVEFOLD_PLAN_WORKERS where set (1: in this process), else one
    per CPU core this process may use (at most `MAX_WORKERS`, and one per 1,024 layouts) for a search of at least
    `PARALLEL_MIN_LAYOUTS`, else 1."""
    text = os.environ.get("FIVEFOLD_PLAN_WORKERS", "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise CliError(f"FIVEFOLD_PLAN_WORKERS = {shown(text)} must be a whole number >= 1 (1: no pool)")
        return int(text)
    if n_layouts < PARALLEL_MIN_LAYOUTS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS, n_layouts // (PARALLEL_MIN_LAYOUTS // 4)))


@dataclass(frozen=True)
class _Job:
    """What judging a layout needs besides the layout (sent once to each process of a pool)."""
    cfg: ModelConfig
    seq: int
    fw: Framework
    hw: Cluster
    recompute: tuple[str, ...]
    moe_imbalance: float
    docs: DocumentLengths | None


@dataclass
class _Judged:
    base: Layout  # with full recompute
    misfit_peak: float | None  # the peak bytes when not even full recompute fits
    need_recompute: list[str] = field(default_factory=list)  # the variants that need more recompute (short form)
    fitting: list[Estimate] = field(default_factory=list)  # the variants that fit, estimated with the closed form


def _judge(job: _Job, base: Layout) -> _Judged:
    """One layout family: whether it fits with full recompute, then each recompute mode's fit and estimate."""
    ok, peak, full_mem = _fits(job.cfg, job.seq, base, job.fw, job.hw, job.moe_imbalance)
    if not ok:
        return _Judged(base, peak)
    out = _Judged(base, None)
    for rc in job.recompute:
        lay, mem = dataclasses.replace(base, recompute=rc), full_mem
        if rc != "full":
            ok, _, mem = _fits(job.cfg, job.seq, lay, job.fw, job.hw, job.moe_imbalance)
            if not ok:
                out.need_recompute.append(lay.short())
                continue
        out.fitting.append(estimate(job.cfg, job.seq, lay, job.fw, job.hw, False, moe_imbalance=job.moe_imbalance,
                                    docs=job.docs, mem=mem))
    return out


def _simulate(job: _Job, e: Estimate) -> Estimate:
    """A candidate estimated again with its schedule simulated action by action (`pipeline_makespan`'s exact path)."""
    return estimate(job.cfg, job.seq, e.layout, job.fw, job.hw, True, moe_imbalance=job.moe_imbalance,
                    docs=job.docs, mem=e.memory)


_WORKER_JOB: _Job | None = None


def _start_worker(job: _Job) -> None:
    global _WORKER_JOB
    _WORKER_JOB = job


def _run_chunk(task: Callable, items: list) -> list:
    assert _WORKER_JOB is not None, "a search worker runs after _start_worker"
    return [task(_WORKER_JOB, item) for item in items]


class SearchPool:
    """Runs a task (`_judge`, `_simulate`: a function of the job and an item) over a list, in order: in this
    process, or in a pool of processes started by a fork server (each imports the planner afresh: nothing of this
    process's threads or state is forked). One pool can serve a series of searches (`search(pool=...)`: `plan
    scaling`, one search per node count): its processes are kept from one search to the next while the job and
    their number stay the same, so each starts (and builds its schedules) once. A pool that breaks (e.g. a script
    without `if __name__ == "__main__":`, which its processes import again) leaves the work to this process, with a
    warning, for the rest of the series."""

    def __init__(self) -> None:
        self.job: _Job | None = None
        self.workers = 1  # the processes of the search under way (1: this process)
        self.pool: ProcessPoolExecutor | None = None
        self.started: tuple[_Job, int] | None = None  # the job and number of processes `pool` was started with
        self.broken = False

    def __enter__(self) -> SearchPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, job: _Job, workers: int) -> int:
        """Judge for `job` with `workers` processes (1: in this process) until the next start, keeping the running
        processes where they were started for an equal job and as many. Returns the processes that judge: 1 once
        the pool has broken."""
        self.job, self.workers = job, 1 if self.broken else workers
        if self.workers > 1 and self.started != (job, self.workers):
            self.close()
            context = multiprocessing.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")
            self.pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_start_worker,
                                            initargs=(job,))
            self.started = (job, self.workers)
        return self.workers

    def close(self, wait: bool = True) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
        self.pool, self.started = None, None

    def map(self, task: Callable, items: list, group: Callable | None = None) -> list:
        """`task` over `items`, the results in their order; `group(item)`: a key that sends items sharing it to the
        same chunk as far as the chunks allow (layouts of one pipeline shape share its schedule, which each
        process builds for itself)."""
        assert self.job is not None, "a search pool maps after start"
        if self.workers > 1 and self.pool is not None and items:
            order = sorted(range(len(items)), key=lambda i: group(items[i])) if group else list(range(len(items)))
            size = max(1, -(-len(items) // (8 * self.workers)))  # about 8 chunks per process, to balance them
            chunks = [[items[i] for i in order[k:k + size]] for k in range(0, len(order), size)]
            try:
                done = [y for part in self.pool.map(_run_chunk, [task] * len(chunks), chunks) for y in part]
                out: list = [None] * len(items)
                for i, y in zip(order, done, strict=True):
                    out[i] = y
                return out
            except (BrokenProcessPool, OSError) as e:  # a pool that could not start or lost a process
                print(f"fivefold plan: warning: the search's pool of {self.workers} processes failed ({e}); "
                      "judging the layouts in this process (FIVEFOLD_PLAN_WORKERS=1 skips the pool)",
                      file=sys.stderr)
                self.close(wait=False)
                self.workers, self.broken = 1, True
        return [task(self.job, item) for item in items]


def _bases(cfg: ModelConfig, seq: int, batch: int, n_gpus: int, hw: Cluster, space: SearchSpace,
           reject: Callable[..., None], hsdp_ranks: int = 0) -> Iterator[Layout]:
    """Every layout that the rule book (`fivefold.layout`) accepts for this model, world and batch, with full
    recompute (the variants with less recompute are tried by the caller); `reject(reason, example)` counts the
    rest by the rule they break. Each rule is checked as soon as its degrees are chosen, to prune early. With
    `hsdp_ranks` (a node's GPUs), each ZeRO-3 layout spanning more than a node also comes as HSDP with one node's
    ranks per shard group."""
    max_tp = space.max_tp or hw.gpus_per_node
    for tp in divisors(n_gpus):
        if not space.allows("tp", tp):
            continue
        if tp > max_tp:
            reject("tp above the GPUs of a node", f"tp={tp} > {max_tp}")
            continue
        problem = tensor_parallel_problem(cfg, tp)
        if problem:
            reject(problem.rule, f"tp={tp}")
            continue
        for cp in divisors(n_gpus // tp) if space.cp or not space.allows("cp", 1) else [1]:
            if not space.allows("cp", cp):
                continue
            problem = sequence_length_problem(seq, cp) if cp > 1 else None
            if problem:
                reject(problem.rule, f"cp={cp}, seq={seq}")
                continue
            for pp in divisors(n_gpus // (tp * cp)):
                dp = n_gpus // (tp * cp * pp)
                if not (space.allows("pp", pp) and space.allows("dp", dp)):
                    continue
                # the pp and dp rules alone: a probe with one-sequence micro-batches under 1F1B
                probe = Layout(dp=dp, pp=pp)
                problem = batch_problem(probe, batch) or pipeline_problem(cfg, probe, seq, batch)
                if problem:
                    reject(problem.rule, f"pp={pp}, dp={dp}, batch={batch} sequences")
                else:
                    yield from _inner(cfg, seq, dp, tp, pp, cp, batch, n_gpus, space, reject, hsdp_ranks)


def _inner(cfg: ModelConfig, seq: int, dp: int, tp: int, pp: int, cp: int, batch: int, n_gpus: int,
           space: SearchSpace, reject: Callable[..., None], hsdp_ranks: int = 0) -> Iterator[Layout]:
    # HSDP's shard degree: the dp ranks of one node (with cp, the shard group is dp_shard x cp x tp = a node)
    dp_shard = hsdp_ranks // (tp * cp) if hsdp_ranks and hsdp_ranks % (tp * cp) == 0 else 0
    if not (dp_shard and dp % dp_shard == 0 and 1 <= dp_shard < dp):
        dp_shard = 0
    eps = [e for e in divisors(cfg.n_experts) if (dp * cp) % e == 0] if cfg.is_moe else [1]
    mbs_list = [m for m in divisors(batch // dp) if m <= space.max_mbs]
    for ep, mbs in itertools.product(eps, mbs_list):
        if not (space.allows("ep", ep) and space.allows("micro_batch_size", mbs)):
            continue
        ga = batch // (dp * mbs)
        for (sched, v), zero in itertools.product(_schedules(pp, space), space.zero):
            if zero and dp * cp == 1:
                continue  # ZeRO has nothing to shard: the same layout as zero = 0
            # MoE under tp: whole experts (etp = 1) and experts split over tp (etp = tp)
            etps = (1, tp) if cfg.is_moe and tp > 1 else (1,)
            for sp, etp in itertools.product(space.sp if tp > 1 else (False,), etps):
                lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, zero=zero, micro_batch_size=mbs,
                             recompute="full", sp=sp, schedule=sched, vpp=v, fp32_grad_accum=space.fp32_grad_accum,
                             grad_accum_steps=ga)
                problem = layout_problem(cfg, lay, world_size=n_gpus, seq_len=seq, global_batch_size=batch)
                if problem:
                    reject(problem.rule, lay.short())
                    continue
                yield lay
                if zero == 3 and dp_shard:
                    twin = dataclasses.replace(lay, dp_shard=dp_shard)
                    if hsdp_problem(twin) is None:  # the rule book's HSDP rule (ep must divide its shard group)
                        yield twin


def _schedules(pp: int, space: SearchSpace) -> Iterator[tuple[str, int]]:
    """The (schedule, vpp) pairs to try; the rule book refuses those that this pp, batch and model cannot run."""
    if pp == 1:
        yield "1f1b", 1
        return
    for name in space.schedules:
        for v in space.vpp if name == "interleaved" else (1,):
            yield name, v


def _fits(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, hw: Cluster, moe_imbalance: float
          ) -> tuple[bool, float, dict[str, dict[str, float]]]:
    """Whether the layout fits, its peak bytes and its `memory_of`."""
    mem = with_heap_retention(memory_of(cfg, seq, lay, fw, moe_imbalance), hw.heap_retention)
    peak = max(sum(v.values()) for v in mem.values())
    return peak <= hw.memory_bytes * fw.usable_memory_fraction, peak, mem


# the largest --global-batch: 2^40 tokens (1T; the largest published batches hold about 2^24) and 2^14 sequences
# (4 x the largest published, about 4,096): the schedules of pipelined layouts are built micro-batch by micro-batch,
# so the search's time grows with the batch (8 devices: 4,096 sequences about 5 s, 16,384 about 13 s, on the 2-core
# machine); above SLOW_BATCH_SEQUENCES the command line warns
MAX_BATCH_TOKENS = 1 << 40
MAX_BATCH_SEQUENCES = 1 << 14
SLOW_BATCH_SEQUENCES = 1 << 12


def announce_search(label: str = "") -> Callable[[int, int], None]:
    """A `search(progress=...)` callback for the command line: one line on stderr for a search of seconds or more
    (`PARALLEL_MIN_LAYOUTS` layouts); `label` says which search (e.g. `16 nodes: `)."""
    def progress(layouts: int, workers: int) -> None:
        if layouts >= PARALLEL_MIN_LAYOUTS:
            where = f"{workers} processes (FIVEFOLD_PLAN_WORKERS sets the count)" if workers > 1 else "1 process"
            print(f"fivefold plan: {label}judging {layouts:,} layouts on {where}", file=sys.stderr, flush=True)
    return progress


def parse_tokens(text: str, flag: str = "--global-batch", most: int = MAX_BATCH_TOKENS) -> int:
    """`1M` -> 1,048,576: K/M/G in powers of two, as the playbook counts batch sizes; `flag` names the option in
    errors, `most` is its largest value."""
    t = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = float(num) * mult
    except ValueError:
        raise CliError(f"{flag} {shown(text)} is not a token count such as 1M, 4096K or 1048576") from None
    if not math.isfinite(value) or value < 1 or not float(value).is_integer():
        raise CliError(f"{flag} {shown(text)} must be a whole number of tokens >= 1")
    if value > most:
        raise CliError(f"{flag} {shown(text)} = {value:,.0f} tokens is above the most the planner takes, "
                       f"{most:,} (2^{most.bit_length() - 1})")
    return int(value)


def gib(x: float) -> float:
    return x / GIB
