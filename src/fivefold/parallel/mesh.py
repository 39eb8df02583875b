"""The process grid: which rank holds which coordinate of the layout, and the process groups of each axis.

Ranks are laid out with tp innermost (neighbouring ranks, so that tensor parallel stays inside a node),
then cp, then dp, and pp outermost:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Expert parallel does not add ranks: it folds over the dp x cp ranks of the expert layers (as Megatron and
torchtitan do), so an ep group is a block of `ep` consecutive ranks of one dp x cp group, and the expert
layers' gradients are reduced over the dp x cp ranks that hold the same experts (`edp`).

`validate_layout` checks the whole layout against the model, the batch and the world size before any
process group exists; `ProcessGrid.build` then creates every group (all ranks create all groups, in the
same order, as torch requires) and keeps the calling rank's own. The grid is passed explicitly to whatever
needs it: nothing here is global.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

from fivefold.config import Config, ConfigError, LayoutConfig, nearest_divisors

AXES = ("pp", "dp", "cp", "tp")  # outermost first


def _nearest_multiples(value: int, base: int) -> list[int]:
    lo = max(base, value // base * base)
    return sorted({lo, lo + base})


def validate_layout(cfg: Config, world_size: int) -> None:
    """Refuse a layout that cannot run on `world_size` ranks, naming the constraint and valid values.

    Called before any process group is created (and by `fivefold train` before any process starts)."""
    la, m, t = cfg.layout, cfg.model, cfg.train
    product = la.dp * la.tp * la.pp * la.cp
    if product != world_size:
        nearest_dp = world_size // (la.tp * la.pp * la.cp) if world_size % (la.tp * la.pp * la.cp) == 0 else None
        hint = (f"with these tp, pp and cp use layout.dp = {nearest_dp}" if nearest_dp
                else f"tp x pp x cp = {la.tp * la.pp * la.cp} must divide the world size; "
                     f"valid tp for {world_size} ranks: {nearest_divisors(world_size, la.tp)}")
        raise ConfigError(
            f"layout dp x tp x pp x cp = {la.dp} x {la.tp} x {la.pp} x {la.cp} = {product} does not equal the "
            f"world size {world_size} (number of processes); {hint}, or start {product} processes "
            f"(--nproc {product})"
        )
    if la.tp > 1:
        from fivefold.parallel.tensor import validate_tensor_parallel

        validate_tensor_parallel(m, la.tp)
    if la.sp and la.tp == 1:
        raise ConfigError("layout.sp = true needs tensor parallel: sequence parallel shards the norm and residual "
                          "regions over the tp ranks; use layout.tp >= 2 or layout.sp = false")
    if la.cp > 1:
        validate_context_parallel(cfg)
    if la.sp and t.seq_len % (la.tp * la.cp):
        local = "" if la.cp == 1 else f" (the cp-local length train.seq_len / layout.cp = {t.seq_len // la.cp})"
        multiple = math.lcm(la.tp * la.cp, 2 * la.cp if la.cp > 1 else 1)
        raise ConfigError(
            f"train.seq_len = {t.seq_len}{local} is not divisible by layout.tp = {la.tp}, which sequence parallel "
            f"(layout.sp = true) needs; nearest valid seq_len: {_nearest_multiples(t.seq_len, multiple)}"
        )
    if la.ep > 1:
        validate_expert_parallel(cfg)
    if la.zero > 0 and la.dp * la.cp == 1:
        raise ConfigError(
            f"layout.zero = {la.zero} with layout.dp = 1 and layout.cp = 1: ZeRO shards over the data-parallel x "
            "context-parallel ranks (those that reduce gradients), so there is nothing to shard; use "
            "layout.zero = 0, or layout.dp >= 2 (or layout.cp >= 2)"
        )
    mbs = la.micro_batch_size or t.global_batch_size // max(la.dp, 1)
    if t.global_batch_size % (la.dp * mbs):
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by layout.dp x "
            f"layout.micro_batch_size = {la.dp} x {mbs} = {la.dp * mbs}; nearest valid global batch sizes: "
            f"{_nearest_multiples(t.global_batch_size, la.dp * mbs)}, or micro-batch sizes "
            f"{nearest_divisors(max(t.global_batch_size // la.dp, 1), mbs)}"
        )
    from fivefold.parallel.pipeline import validate_pipeline

    validate_pipeline(cfg)


def validate_context_parallel(cfg: Config) -> None:
    """cp cuts every sequence into 2*cp zig-zag chunks (see `fivefold.parallel.context`)."""
    from fivefold.parallel.context import check_sequence_length

    check_sequence_length(cfg.train.seq_len, cfg.layout.cp)


def validate_expert_parallel(cfg: Config) -> None:
    """ep shards whole experts of an MoE model over blocks of ep ranks of each dp x cp group."""
    la, m = cfg.layout, cfg.model
    if not m.is_moe:
        raise ConfigError(
            f"layout.ep = {la.ep} on a dense model (model.n_experts = 0): expert parallel shards the experts of "
            "mixture-of-experts layers; use layout.ep = 1, or an MoE model (model.n_experts >= 2, e.g. "
            "--preset tiny-moe)"
        )
    if m.n_experts % la.ep:
        raise ConfigError(
            f"layout.ep = {la.ep} does not divide model.n_experts = {m.n_experts}: each ep rank holds "
            f"n_experts / ep whole experts; valid ep for this model: {nearest_divisors(m.n_experts, la.ep)}"
        )
    if (la.dp * la.cp) % la.ep:
        valid = [d for d in nearest_divisors(la.dp * la.cp, la.ep, 8) if m.n_experts % d == 0][:3]
        raise ConfigError(
            f"layout.ep = {la.ep} does not divide layout.dp x layout.cp = {la.dp} x {la.cp} = {la.dp * la.cp}: "
            f"expert parallel folds over the dp x cp ranks (it adds no ranks), so each dp x cp group must split "
            f"into blocks of ep ranks; valid ep for this layout and model: {valid}, or raise layout.dp"
        )
    if la.zero == 3:
        raise ConfigError(
            f"layout.zero = 3 with layout.ep = {la.ep}: ZeRO-3 shards parameters with one fully_shard mesh over "
            "dp x cp, while expert weights are reduced over the smaller expert-data-parallel groups; use "
            "layout.zero = 1 or 2 with expert parallel, or layout.ep = 1"
        )


def rank_of(layout: LayoutConfig, pp: int, dp: int, cp: int, tp: int) -> int:
    return ((pp * layout.dp + dp) * layout.cp + cp) * layout.tp + tp


def coordinates(layout: LayoutConfig, rank: int) -> dict[str, int]:
    """{"pp", "dp", "cp", "tp"} coordinates of `rank` (tp innermost)."""
    coords = {}
    for axis in reversed(AXES):
        size = getattr(layout, axis)
        coords[axis] = rank % size
        rank //= size
    return coords


def axis_groups(layout: LayoutConfig, axes: tuple[str, ...]) -> list[list[int]]:
    """The rank lists of the groups spanning `axes` (ranks that differ only in those coordinates)."""
    world = layout.dp * layout.tp * layout.pp * layout.cp
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        c = coordinates(layout, rank)
        key = tuple(c[a] for a in AXES if a not in axes)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def expert_groups(layout: LayoutConfig) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, expert-data-parallel groups): ep folds over each dp x cp group, whose ranks are split
    into blocks of `ep` consecutive members; ranks at the same position of every block replicate the same
    experts and reduce their gradients together."""
    ep_lists, edp_lists = [], []
    for members in axis_groups(layout, ("dp", "cp")):
        blocks = [members[i:i + layout.ep] for i in range(0, len(members), layout.ep)]
        ep_lists += blocks
        edp_lists += [list(column) for column in zip(*blocks, strict=True)]
    return ep_lists, edp_lists


# the groups every rank builds: one per axis, plus the combinations that reduce gradients
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
    "dp_cp": ("dp", "cp"),  # reduces the gradients of dense parameters (cp ranks see other tokens)
}


@dataclass
class ProcessGrid:
    """This rank's coordinates and its groups. `sizes` and `ranks` are per axis name."""

    layout: LayoutConfig
    rank: int
    world_size: int
    ranks: dict[str, int] = field(default_factory=dict)
    groups: dict[str, ProcessGroup] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, cfg: Config) -> ProcessGrid:
        """Validate the layout for the initialised world, then create every group."""
        world, rank = dist.get_world_size(), dist.get_rank()
        validate_layout(cfg, world)
        grid = cls(cfg.layout, rank, world, ranks=coordinates(cfg.layout, rank))
        for name, axes in GROUP_AXES.items():
            grid._add(name, axis_groups(cfg.layout, axes))
        if cfg.layout.pp > 1:  # the first and last pipeline ranks, which hold the tied embedding's two copies
            grid._add("embed", [[members[0], members[-1]] for members in axis_groups(cfg.layout, ("pp",))])
        ep_lists, edp_lists = expert_groups(cfg.layout)
        grid._add("ep", ep_lists)
        grid._add("edp", edp_lists)
        return grid

    def _add(self, name: str, rank_lists: list[list[int]]) -> None:
        for members in rank_lists:  # every rank creates every group, in the same order
            group = dist.new_group(members)
            if self.rank in members:
                self.groups[name], self.group_ranks[name] = group, members

    def size(self, axis: str) -> int:
        return len(self.group_ranks[axis])

    @property
    def tp_group(self) -> ProcessGroup:
        return self.groups["tp"]

    @property
    def grad_group(self) -> ProcessGroup:
        """The ranks over which dense gradients are reduced (dp x cp)."""
        return self.groups["dp_cp"]
