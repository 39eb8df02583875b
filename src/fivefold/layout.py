"""The rule book of layouts: whether a layout can run a model on a world of devices, and why not.

One function decides, for `fivefold train` (before any process starts, and again in `ProcessGrid.build` for the
world that was initialised), for `fivefold plan --layout` and for the planner's search alike: `layout_problem`
returns the first rule a layout breaks (None when it can run) and `check_layout` raises it as a `ConfigError`
(`raise_problem`, which every caller of a single rule uses too). Each rule is also a
function of its own (`tensor_parallel_problem`, `pipeline_problem`, ...), which the search calls early to prune
whole families of layouts; every layout it proposes passes `layout_problem` (tests/test_layout_rules.py).

A `LayoutProblem` has a short `rule` (what the search counts rejected layouts by) and a `message` that names
the field, the value, the rule and values that would work.

A field set where it means nothing (a schedule without a pipeline, `etp` on a dense model, ...) is not refused: a
pipelined run resumed on one process keeps its config, schedule and all. `NO_EFFECT` lists those cases, one rule
each, and `layout_notes` words the ones a layout meets as the `note:` lines that `fivefold train` (and
`--dry-run`) and `fivefold plan --layout` print at start.

This module is one part with `config` (whose `validate` applies `batch_problem`) and imports nothing from
`parallel`, `train` or `planner`; the few facts
of pipeline schedules that the rules need (how many stages a schedule places, how many micro-batches it needs)
live here and `parallel.schedules` uses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from fivefold.config import Config, ConfigError, LayoutConfig, ModelConfig, nearest_divisors, shown
from fivefold.flops import balanced_stage_layers

__all__ = ["NO_EFFECT", "SCHEDULES", "LayoutProblem", "NoEffect", "batch_problem", "check_layout",
           "context_parallel_problem", "expert_parallel_problem", "layout_notes", "layout_problem",
           "min_micro_batches", "n_stages", "pipeline_problem", "raise_problem", "sequence_length_problem",
           "stage_count", "tensor_parallel_problem"]


class LayoutProblem(NamedTuple):
    """A rule that a layout breaks: `rule` in a few words (what the planner counts rejections by) and the
    `message` of the `ConfigError` (field, value, rule and values that would work)."""

    rule: str
    message: str


def raise_problem(problem: LayoutProblem | None) -> None:
    """Raise `problem` as the `ConfigError` its message describes; nothing when there is none."""
    if problem is not None:
        raise ConfigError(problem.message)


def nearest_multiples(value: int, base: int) -> list[int]:
    """The multiples of `base` on either side of `value` (at least `base`), for error messages."""
    lo = max(base, value // base * base)
    return sorted({lo, lo + base})


# ---------------------------------------------------------------------------------------------
# Facts of the pipeline schedules that the rules need

SCHEDULES = ("afab", "1f1b", "interleaved", "zero-bubble", "dualpipev")
SPLIT = ("zero-bubble", "dualpipev")  # the schedules whose backward is B and W passes (`Schedule.split_backward`)
# under `layout.tp_comm_overlap` a row-parallel linear reduce-scatters its output in this many pieces along the
# sequence, each launched when its matmul is done and reduced under the next piece's (`tensor_comm.linear_scatter`)
SCATTER_PIECES = 2
# tokens per chunk of the fused output layer + loss: fp32 logits exist for this many tokens at a time
# (`models.loss.chunked_loss`); the same for the vocabulary-parallel loss under tensor parallel
# (`parallel.tensor.vocab_parallel_loss_sum`). The values the engines use and the planner's memory and time models
# assume (`planner.layout.Framework`)
LOSS_CHUNK_TOKENS = 8192
TP_LOSS_CHUNK_TOKENS = 4096


def min_micro_batches(name: str, p: int, v: int = 1) -> int:
    """The fewest micro-batches the schedule accepts (and, for interleaved, m must be a multiple of p)."""
    if name == "dualpipev":
        return 2 * p
    if name == "interleaved":
        return p
    return 1


def stage_count(schedule: str, pp: int, vpp: int = 1) -> int:
    """Global pipeline stages: pp, pp x vpp (interleaved) or 2 pp (the V of DualPipeV); 1 without a pipeline."""
    if pp == 1:
        return 1
    if schedule == "dualpipev":
        return 2 * pp
    return pp * (vpp if schedule == "interleaved" else 1)


def n_stages(layout: LayoutConfig) -> int:
    return stage_count(layout.schedule, layout.pp, layout.vpp)


# ---------------------------------------------------------------------------------------------
# The rules, one function each


def batch_problem(layout: LayoutConfig, global_batch_size: int) -> LayoutProblem | None:
    """dp must divide the global batch (in sequences), and the micro-batch size the per-rank batch (the rule
    that `Config.validate` applies too: the config's micro-batch and accumulation properties divide by it)."""
    dp = layout.dp
    if global_batch_size % dp:
        return LayoutProblem(
            "dp does not divide the global batch",
            f"train.global_batch_size = {global_batch_size} is not divisible by layout.dp = {dp} (layout.dp does "
            f"not divide the global batch of {global_batch_size} sequences); nearest valid global batch sizes: "
            f"{nearest_multiples(global_batch_size, dp)}, or layout.dp in {nearest_divisors(global_batch_size, dp)}")
    per_rank = global_batch_size // dp
    mbs = layout.micro_batch_size or per_rank
    if per_rank % mbs:
        return LayoutProblem(
            "micro-batch size does not divide the per-rank batch",
            f"layout.micro_batch_size = {mbs} does not divide the per-rank batch train.global_batch_size / "
            f"layout.dp = {per_rank}; valid micro-batch sizes: {nearest_divisors(per_rank, mbs, 5)}")
    return None


def world_problem(layout: LayoutConfig, world_size: int, global_batch_size: int = 0) -> LayoutProblem | None:
    """dp x tp x pp x cp against the processes; the hint's dp also says the batch it needs (`global_batch_size`,
    where given), so that following it does not meet the batch rule next."""
    product = layout.dp * layout.tp * layout.pp * layout.cp
    if product == world_size:
        return None
    rest = layout.tp * layout.pp * layout.cp
    nearest_dp = world_size // rest if world_size % rest == 0 else None
    hint = (f"with these tp, pp and cp use layout.dp = {nearest_dp}" if nearest_dp
            else f"tp x pp x cp = {rest} must divide the world size; "
                 f"valid tp for {world_size} ranks: {nearest_divisors(world_size, layout.tp)}")
    step = (nearest_dp or 0) * (layout.micro_batch_size or 1)
    if nearest_dp and global_batch_size and global_batch_size % step:
        hint += (f" with a global batch divisible by {'dp' if step == nearest_dp else 'dp x micro_batch_size'} = "
                 f"{step} (train.global_batch_size in {nearest_multiples(global_batch_size, step)})")
    return LayoutProblem(
        "dp x tp x pp x cp differs from the world size",
        f"layout dp x tp x pp x cp = {layout.dp} x {layout.tp} x {layout.pp} x {layout.cp} = {product} does not "
        f"equal the world size {world_size} (number of processes); {hint}, or start {product} processes "
        f"(--nproc {product})")


def tensor_parallel_problem(model: ModelConfig, tp: int, field: str = "layout.tp") -> LayoutProblem | None:
    """tp must divide every dimension it splits: heads, kv heads, the vocabulary and the (expert) MLP width."""
    checks = [("model.n_heads", model.n_heads), ("model.n_kv_heads", model.n_kv_heads),
              ("model.vocab_size", model.vocab_size)]
    if model.is_moe:  # the shared experts are n_shared_experts x expert_ffn wide, so expert_ffn is what splits
        checks.append(("model.moe_ffn" if model.moe_ffn else "model.ffn (the expert ffn)", model.expert_ffn))
    else:
        checks.append(("model.ffn", model.ffn))
    if model.qk_norm == "full" and tp > 1:
        return LayoutProblem(
            "tp splits the heads that a whole-projection query/key norm spans",
            f"{field} = {tp} with model.qk_norm = 'full': the norm spans every head of the projection, which tensor "
            "parallelism splits over the tp ranks; use layout.tp = 1 (qk_norm = 'head' splits)")
    for name, value in checks:
        if value % tp:
            return LayoutProblem(
                "tp does not divide the model's heads, kv heads, MLP or vocabulary",
                f"{field} = {tp} does not divide {name} = {value}: tensor parallelism splits it evenly over the "
                f"tp ranks (kv heads are not replicated); valid tp for this model: {_valid_tp(model, tp)}")
    return None


def _valid_tp(model: ModelConfig, tp: int) -> list[int]:
    dims = [model.n_heads, model.n_kv_heads, model.vocab_size, model.expert_ffn if model.is_moe else model.ffn]
    candidates = [d for d in nearest_divisors(model.n_kv_heads, tp, 8) if all(x % d == 0 for x in dims)]
    return sorted(candidates, key=lambda d: (abs(d - tp), d))[:3] or [1]


def sequence_length_problem(seq_len: int, cp: int, field: str = "train.seq_len") -> LayoutProblem | None:
    """Context parallel cuts every sequence into 2*cp equal zig-zag chunks (see `fivefold.parallel.context`)."""
    chunks = 2 * cp
    if seq_len >= chunks and seq_len % chunks == 0:
        return None
    lower = seq_len // chunks * chunks
    nearest = [n for n in (lower, lower + chunks) if n > 0]
    return LayoutProblem(
        "cp does not split the sequence into 2 x cp chunks",
        f"{field} = {seq_len} cannot be split for context parallel with cp = {cp}: the sequence is cut into "
        f"2*cp = {chunks} equal chunks (rank r keeps chunks r and {chunks - 1}-r), so the length must be a "
        f"multiple of {chunks}; nearest valid lengths: {', '.join(map(str, nearest))}")


def context_parallel_problem(layout: LayoutConfig, seq_len: int) -> LayoutProblem | None:
    return sequence_length_problem(seq_len, layout.cp) if layout.cp > 1 else None


def sequence_parallel_problem(layout: LayoutConfig, seq_len: int) -> LayoutProblem | None:
    if layout.sp and layout.tp == 1:
        return LayoutProblem(
            "sequence parallel without tensor parallel",
            "layout.sp = true needs tensor parallel: sequence parallel shards the norm and residual regions over "
            "the tp ranks; use layout.tp >= 2 or layout.sp = false")
    if layout.sp and seq_len % (layout.tp * layout.cp):
        local = "" if layout.cp == 1 else \
            f" (the cp-local length train.seq_len / layout.cp = {seq_len // layout.cp})"
        multiple = math.lcm(layout.tp * layout.cp, 2 * layout.cp if layout.cp > 1 else 1)
        return LayoutProblem(
            "sequence parallel with seq not divisible by tp x cp",
            f"train.seq_len = {seq_len}{local} is not divisible by layout.tp = {layout.tp}, which sequence "
            f"parallel (layout.sp = true) needs; nearest valid seq_len: {nearest_multiples(seq_len, multiple)}")
    return None


def expert_parallel_problem(model: ModelConfig, layout: LayoutConfig) -> LayoutProblem | None:
    """ep shards whole experts of an MoE model over blocks of ep ranks of each dp x cp group."""
    ep = layout.ep
    if ep == 1:
        return None
    if not model.is_moe:
        return LayoutProblem(
            "ep on a dense model",
            f"layout.ep = {ep} on a dense model (model.n_experts = 0): expert parallel shards the experts of "
            "mixture-of-experts layers; use layout.ep = 1, or an MoE model (model.n_experts >= 2, e.g. "
            "--preset tiny-moe)")
    if model.n_experts % ep:
        return LayoutProblem(
            "ep does not divide the experts",
            f"layout.ep = {ep} does not divide model.n_experts = {model.n_experts}: each ep rank holds "
            f"n_experts / ep whole experts; valid ep for this model: {nearest_divisors(model.n_experts, ep)}")
    group = layout.dp * layout.cp
    if group % ep:
        valid = [d for d in nearest_divisors(group, ep, 8) if model.n_experts % d == 0][:3]
        return LayoutProblem(
            "ep does not divide dp x cp",
            f"layout.ep = {ep} does not divide layout.dp x layout.cp = {layout.dp} x {layout.cp} = {group}: "
            f"expert parallel folds over the dp x cp ranks (it adds no ranks), so each dp x cp group must split "
            f"into blocks of ep ranks; valid ep for this layout and model: {valid}, or raise layout.dp")
    return None


def expert_tensor_parallel_problem(model: ModelConfig, layout: LayoutConfig, seq_len: int) -> LayoutProblem | None:
    """etp (the tp ranks a routed expert is split over) is 1 or tp; with whole experts (etp = 1) under tp each tp
    rank routes its own part of every sequence, so the (cp-local) sequence must split over tp."""
    if layout.etp not in (1, layout.tp):
        return LayoutProblem(
            "etp neither 1 nor tp",
            f"layout.etp = {layout.etp} must be 1 (whole experts, tokens split over the tp ranks) or layout.tp = "
            f"{layout.tp} (every expert's ffn dim split over tp)" + (
                f"; etp = {layout.etp} needs layout.tp = {layout.etp}" if layout.etp > 1 else ""))
    if not model.is_moe or not layout.splits_tokens_over_tp or (seq_len // layout.cp) % layout.tp == 0:
        return None
    local = "" if layout.cp == 1 else f" (the cp-local length train.seq_len / layout.cp = {seq_len // layout.cp})"
    multiple = layout.tp * layout.cp * (2 if layout.cp > 1 else 1)
    return LayoutProblem(
        "whole experts with seq not divisible by tp",
        f"train.seq_len = {seq_len}{local} is not divisible by layout.tp = {layout.tp}: with whole experts "
        f"(layout.etp = 1) each tp rank routes its own 1/tp of every sequence; nearest valid seq_len: "
        f"{nearest_multiples(seq_len, multiple)}, or layout.etp = {layout.tp} (experts split over tp)")


def hsdp_problem(layout: LayoutConfig) -> LayoutProblem | None:
    """HSDP (`dp_shard`): ZeRO-3 sharded inside groups of dp_shard x cp ranks, replicated across dp / dp_shard."""
    s = layout.dp_shard
    if not s:
        return None
    if s < 0 or layout.dp % s or s >= layout.dp:
        valid = [d for d in range(1, layout.dp) if layout.dp % d == 0]
        return LayoutProblem("dp_shard not a divisor of dp below dp",
                             f"layout.dp_shard = {s} must divide layout.dp = {layout.dp} and be smaller (dp / "
                             f"dp_shard replicas of each shard; 0 = no HSDP); valid dp_shard: {valid or [0]}")
    if layout.zero != 3:
        return LayoutProblem("HSDP without ZeRO-3",
                             f"layout.dp_shard = {s} is HSDP, which shards ZeRO-3's states; it needs layout.zero = 3 "
                             f"(got {layout.zero}), or dp_shard = 0")
    if layout.ep > 1 and layout.zero_group % layout.ep:
        valid = [d for d in range(1, layout.dp) if layout.dp % d == 0 and d * layout.cp % layout.ep == 0]
        return LayoutProblem("HSDP shard group not a multiple of ep",
                             f"layout.dp_shard x layout.cp = {s} x {layout.cp} must be a multiple of layout.ep = "
                             f"{layout.ep}: expert parallel folds over blocks of ep ranks, and each shard group must "
                             f"hold whole blocks (its experts shard over the group's ranks that hold the same "
                             f"experts); valid dp_shard: {valid or [0]}")
    return None


def communication_problem(layout: LayoutConfig) -> LayoutProblem | None:
    """The gradient buckets' size and the overlap switches (ZeRO-1/2's parameter all-gather, the pipeline's
    point-to-point): set only where they mean something."""
    size = layout.dp_bucket_size
    if size is not None and size < 1:
        return LayoutProblem("bucket size below one element",
                             f"layout.dp_bucket_size = {size} must be >= 1 (elements per gradient bucket), or null "
                             "(left out) for Megatron's rule, max(40,000,000, 1,000,000 x dp x cp)")
    if size is not None and layout.zero == 3:
        return LayoutProblem("bucket size under ZeRO-3",
                             f"layout.dp_bucket_size = {size} with layout.zero = 3: ZeRO-3 reduce-scatters each "
                             "block's gradients as one unit and has no buckets; leave dp_bucket_size out, or use "
                             "layout.zero = 0, 1 or 2")
    if layout.dp_overlap_param_gather and not layout.gathers_params_after_step:
        return LayoutProblem("parameter all-gather overlap without ZeRO-1/2",
                             f"layout.dp_overlap_param_gather = true with layout.zero = {layout.zero}, dp x cp = "
                             f"{layout.dp * layout.cp}: only ZeRO-1/2 over two or more ranks all-gather the "
                             "parameters after the step (ZeRO-3 gathers each block before its forward, ZeRO-0 "
                             "gathers nothing); leave it out, or use layout.zero = 1 or 2 with dp x cp >= 2")
    if layout.tp_comm_overlap and not (layout.tp > 1 and layout.sp):
        return LayoutProblem("tensor-parallel overlap without sequence parallel",
                             f"layout.tp_comm_overlap = true with layout.tp = {layout.tp}, layout.sp = "
                             f"{str(layout.sp).lower()}: only sequence parallel's gathered linears have collectives "
                             "to overlap in backward; leave it out, or use layout.tp >= 2 with layout.sp = true")
    if layout.pp_fb_overlap and not layout.fb_overlap_applies:
        return LayoutProblem("forward/backward overlap where DualPipeV's pairs do not run as lanes",
                             f"layout.pp_fb_overlap = true with layout.schedule = {layout.schedule}, pp = {layout.pp}, "
                             f"tp x cp x ep = {layout.tp * layout.cp * layout.ep}, zero = {layout.zero}: the overlap "
                             "runs DualPipeV's forward and backward pairs over pp >= 2 whose stages have collectives "
                             "(tp, cp or ep > 1), not under ZeRO-3; leave it out, or use such a layout")
    if layout.pp_comm_overlap and layout.pp == 1:
        return LayoutProblem("pipeline overlap without a pipeline",
                             "layout.pp_comm_overlap = true with layout.pp = 1: there is no point-to-point to "
                             "overlap; leave it out, or use layout.pp >= 2")
    return None


def zero_problem(layout: LayoutConfig) -> LayoutProblem | None:
    if layout.zero > 0 and layout.dp * layout.cp == 1:
        return LayoutProblem(
            "ZeRO without data or context parallel",
            f"layout.zero = {layout.zero} with layout.dp = 1 and layout.cp = 1: ZeRO shards over the "
            "data-parallel x context-parallel ranks (those that reduce gradients), so there is nothing to shard; "
            "use layout.zero = 0, or layout.dp >= 2 (or layout.cp >= 2)")
    return None


def _micro_batch_sizes_for(per_rank: int, need: int, multiple: int = 1) -> list[int]:
    """The largest micro-batch sizes that give at least `need` micro-batches (a multiple of `multiple`)."""
    sizes = [d for d in range(per_rank, 0, -1) if per_rank % d == 0 and per_rank // d >= need
             and (per_rank // d) % multiple == 0]
    return sizes[:3]


def pipeline_problem(model: ModelConfig, layout: LayoutConfig, seq_len: int, global_batch_size: int
                     ) -> LayoutProblem | None:
    """The stages, the schedule and its micro-batches (the batch rules are assumed to hold)."""
    la = layout
    if la.pp == 1:
        if la.vpp > 1:
            return LayoutProblem("vpp without pipeline parallel",
                                 f"layout.vpp = {la.vpp} needs pipeline parallel (layout.pp > 1) and the interleaved "
                                 "schedule; use layout.vpp = 1")
        if la.stage_layers:
            return LayoutProblem("stage_layers without pipeline parallel",
                                 f"layout.stage_layers = {la.stage_layers} splits the blocks over pipeline stages, "
                                 "but layout.pp = 1; leave it empty or use layout.pp >= 2")
        return None
    if la.pp > model.n_layers:
        return LayoutProblem("pp above the number of layers",
                             f"layout.pp = {la.pp} exceeds model.n_layers = {model.n_layers}: every pipeline stage "
                             f"holds at least one block; use layout.pp <= {model.n_layers}")
    if la.vpp > 1 and la.schedule != "interleaved":
        return LayoutProblem("vpp with a schedule other than interleaved",
                             f"layout.vpp = {la.vpp} (stages per rank) applies to the interleaved schedule only, "
                             f"not layout.schedule = {la.schedule}; use layout.vpp = 1 or layout.schedule = "
                             "interleaved")
    stages = n_stages(la)
    if stages > model.n_layers:
        what = f"layout.pp x layout.vpp = {la.pp} x {la.vpp}" if la.schedule == "interleaved" else \
            f"the V of dualpipev, 2 x layout.pp = 2 x {la.pp}"
        valid = list(range(1, model.n_layers // la.pp + 1)) if la.schedule == "interleaved" else None
        hint = f"use layout.vpp in {valid[-3:]}" if valid else f"use layout.pp <= {model.n_layers // 2}"
        return LayoutProblem("more pipeline stages than layers",
                             f"{what} = {stages} stages exceed model.n_layers = {model.n_layers}: every stage holds "
                             f"at least one block; {hint}")
    per_rank = global_batch_size // la.dp
    mbs = la.micro_batch_size or per_rank
    m = per_rank // mbs
    need = min_micro_batches(la.schedule, la.pp, la.vpp)
    multiple = la.pp if la.schedule == "interleaved" else 1
    if m < need or m % multiple:
        rule = f"at least {need} micro-batches per step" + (f", a multiple of layout.pp = {la.pp}" if multiple > 1
                                                              else "")
        sizes = _micro_batch_sizes_for(per_rank, need, multiple)
        smallest = -(-need // multiple) * multiple  # the fewest micro-batches that the schedule accepts
        hint = (f"use layout.micro_batch_size in {sizes}" if sizes else
                f"raise train.global_batch_size to {smallest * la.dp} or more")
        return LayoutProblem("too few micro-batches for the schedule",
                             f"layout.schedule = {la.schedule} with layout.pp = {la.pp} needs {rule}, but "
                             f"train.global_batch_size / (layout.dp x layout.micro_batch_size) = "
                             f"{global_batch_size} / ({la.dp} x {mbs}) = {m}; {hint}, or another schedule")
    if la.stage_layers:
        counts = la.stage_layers
        if len(counts) != stages or min(counts) < 1 or sum(counts) != model.n_layers:
            balanced = balanced_stage_layers(model, stages, seq_len)
            return LayoutProblem("stage_layers do not split the layers over the stages",
                                 f"layout.stage_layers = {counts} must give each of the {stages} pipeline stages at "
                                 f"least one block, {model.n_layers} blocks in all (model.n_layers); the compute-"
                                 f"balanced split is {balanced} (leave layout.stage_layers empty to use it)")
    return None


# ---------------------------------------------------------------------------------------------
# Fields set where they mean nothing: accepted, with a note


class NoEffect(NamedTuple):
    """A layout field whose value the run accepts and ignores: `idle` says whether that is so for a model and a
    layout (the field set, i.e. not its default, where nothing reads it) and `why` says why ("with FIELD = VALUE: the
    reason", after "has no effect"), naming the values that make it so and what would give it an effect."""

    field: str
    idle: Callable[[ModelConfig, LayoutConfig], bool]
    why: Callable[[ModelConfig, LayoutConfig], str]


_DEFAULT = LayoutConfig()


def _experts_reduce_over_tp(model: ModelConfig, la: LayoutConfig) -> bool:
    """Whole routed experts under tp (etp = 1): their gradients are reduced in buckets over the tp ranks (`edp`),
    whatever dp x cp."""
    return model.is_moe and la.splits_tokens_over_tp


# every "set, but no effect" case of the layout (the switches set true where they cannot apply are refused by
# `communication_problem` instead: they ask for work that cannot happen; set false there they ask for what happens;
# pp_comm_overlap under ZeRO-3 or a split schedule, on by default there, is noted whichever value is set)
NO_EFFECT: tuple[NoEffect, ...] = (
    NoEffect("schedule", lambda m, la: la.pp == 1 and la.schedule != _DEFAULT.schedule,
             lambda m, la: "with layout.pp = 1: a schedule orders the micro-batches over pipeline stages, and there is "
                           "one stage; it applies with layout.pp >= 2"),
    NoEffect("etp", lambda m, la: la.etp != _DEFAULT.etp and not m.is_moe,
             lambda m, la: f"on a dense model (model.n_experts = {m.n_experts}): there are no routed experts to "
                           f"split over the tp ranks (the MLP is split over layout.tp = {la.tp} anyway); it applies to "
                           "mixture-of-experts models"),
    NoEffect("dp_bucket_size",
             lambda m, la: la.dp_bucket_size is not None and la.dp * la.cp == 1 and not _experts_reduce_over_tp(m, la),
             lambda m, la: f"with layout.dp x layout.cp = {la.dp} x {la.cp} = 1: gradient buckets are reduced over the "
                           "data-parallel ranks, and no other rank holds the same weights to reduce with" + (
                               "" if la.world_size == 1 else " (the buckets still group this rank's gradients, which "
                               "sets nothing but the order the gradient norm is summed in)") + "; it applies with "
                           "dp x cp >= 2"),
    NoEffect("dp_overlap_param_gather",
             lambda m, la: la.dp_overlap_param_gather is False and not la.gathers_params_after_step,
             lambda m, la: f"with layout.zero = {la.zero}, dp x cp = {la.dp * la.cp}: only ZeRO-1/2 over two or more "
                           "ranks all-gather the parameters after the step, so there is no gather to overlap"),
    NoEffect("tp_comm_overlap", lambda m, la: la.tp_comm_overlap is False and not (la.tp > 1 and la.sp),
             lambda m, la: f"with layout.tp = {la.tp}, layout.sp = {str(la.sp).lower()}: only sequence parallel's "
                           "gathered linears (tp >= 2 with sp) have collectives to overlap"),
    NoEffect("pp_comm_overlap", lambda m, la: la.pp_comm_overlap is False and la.pp == 1,
             lambda m, la: "with layout.pp = 1: there is no point-to-point to overlap"),
    NoEffect("pp_comm_overlap",
             lambda m, la: la.pp_comm_overlap is not None and la.pp > 1 and (la.zero == 3 or la.schedule in SPLIT),
             lambda m, la: (
                 "under layout.zero = 3: the overlap posts a whole backward's input gradient before the weight "
                 "gradients its stage defers, and a ZeRO-3 stage defers none (fully_shard's hooks collect them within "
                 "the backward), so the gradient leaves after the whole backward either way; the receives are posted "
                 "ahead, each waited for alone, with the switch on or off" if la.zero == 3 else
                 f"with layout.schedule = {la.schedule}: the schedule splits every backward into B and W passes "
                 "itself, and B's input gradient leaves before W whatever the switch")),
    NoEffect("pp_fb_overlap", lambda m, la: la.pp_fb_overlap is False and not la.fb_overlap_applies,
             lambda m, la: f"with layout.schedule = {la.schedule}, pp = {la.pp}, tp x cp x ep = "
                           f"{la.tp * la.cp * la.ep}, zero = {la.zero}: only DualPipeV's pairs over pp >= 2 whose "
                           "stages have collectives (tp, cp or ep > 1), not under ZeRO-3, run as overlapped lanes"),
)


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else shown(value)


def layout_notes(model: ModelConfig, layout: LayoutConfig) -> list[str]:
    """One line for each `NO_EFFECT` case that `layout` meets for `model`: the field, its value and why it has no
    effect (the caller prefixes `note: `)."""
    return [f"layout.{case.field} = {_value(getattr(layout, case.field))} has no effect {case.why(model, layout)}"
            for case in NO_EFFECT if case.idle(model, layout)]


# ---------------------------------------------------------------------------------------------
# The whole layout


def layout_problem(model: ModelConfig, layout: LayoutConfig, *, world_size: int, seq_len: int,
                   global_batch_size: int) -> LayoutProblem | None:
    """The first rule `layout` breaks for `model` on `world_size` devices with this sequence length and global
    batch (in sequences), or None when it can run. The order is the engine's: the first problem is the one
    `fivefold train` reports."""
    checks = (
        lambda: world_problem(layout, world_size, global_batch_size),
        lambda: tensor_parallel_problem(model, layout.tp) if layout.tp > 1 else None,
        lambda: sequence_parallel_problem(layout, seq_len) if layout.sp and layout.tp == 1 else None,
        lambda: context_parallel_problem(layout, seq_len),
        lambda: sequence_parallel_problem(layout, seq_len),
        lambda: expert_parallel_problem(model, layout),
        lambda: expert_tensor_parallel_problem(model, layout, seq_len),
        lambda: zero_problem(layout),
        lambda: hsdp_problem(layout),
        lambda: communication_problem(layout),
        lambda: batch_problem(layout, global_batch_size),
        lambda: pipeline_problem(model, layout, seq_len, global_batch_size),
    )
    for check in checks:
        problem = check()
        if problem is not None:
            return problem
    return None


def check_layout(cfg: Config, world_size: int) -> None:
    """Raise `ConfigError` for the first rule the config's layout breaks on `world_size` devices."""
    raise_problem(layout_problem(cfg.model, cfg.layout, world_size=world_size, seq_len=cfg.train.seq_len,
                                 global_batch_size=cfg.train.global_batch_size))
