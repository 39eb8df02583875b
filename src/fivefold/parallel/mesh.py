"""The process grid: which rank holds which coordinate of the layout, and the process groups of each axis.

Ranks are laid out with tp innermost (neighbouring ranks, so that tensor parallel stays inside a node),
then cp, then dp, and pp outermost:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Expert parallel does not add ranks: it folds over the dp x cp ranks of the expert layers (as Megatron and
torchtitan do), so an ep group is a block of `ep` consecutive ranks of one dp x cp group, and the expert
layers' gradients are reduced over the dp x cp ranks that hold the same experts (`edp`), and over the tp ranks
as well when the experts stay whole under tp (`layout.etp = 1`, where each tp rank routes its own tokens).

`ProcessGrid.build` checks the whole layout against the model, the batch and the initialised world
(`fivefold.layout.check_layout`, which the command line has run before any process started), then creates the
calling rank's groups: one communicator creation per distinct set of groups of more than one rank (an axis, or an
axis combination whose groups differ from every earlier one's), so that a rank makes a handful of creations
whatever the world (`communicator_creations`). On a world initialised eagerly on accelerators (a device bound to the
default group, as the launcher does on GPUs) each is one `torch.distributed.split_group` over the whole world, which
every rank calls once (NCCL splits communicators collectively); elsewhere (gloo) each rank calls
`new_group(its members, use_local_synchronization=True)`, in which only the members take part. Axes of size 1 get no
group of their own: every name of size 1 is this rank's one-member group, created once. The grid is passed
explicitly to whatever needs it: nothing here is global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed import ProcessGroup

from fivefold.config import Config, LayoutConfig, shown
from fivefold.layout import check_layout
from fivefold.parallel.pipeline_comm import channel_count

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AXES = ("pp", "dp", "cp", "tp")  # outermost first


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
    experts and reduce their gradients together. With whole experts under tp (etp = 1) the tp ranks route
    different tokens and hold the same experts, so an edp group spans the tp ranks of its pipeline stage too."""
    ep_lists, edp_lists = [], []
    merged: dict[tuple[int, int], list[int]] = {}  # etp = 1: (pp rank, position in the ep block) -> members
    for members in axis_groups(layout, ("dp", "cp")):
        blocks = [members[i:i + layout.ep] for i in range(0, len(members), layout.ep)]
        ep_lists += blocks
        columns = [list(column) for column in zip(*blocks, strict=True)]
        if not layout.splits_tokens_over_tp:
            edp_lists += columns
            continue
        stage = coordinates(layout, members[0])["pp"]
        for j, column in enumerate(columns):
            merged.setdefault((stage, j), []).extend(column)
    return ep_lists, edp_lists + [sorted(m) for m in merged.values()]


def hsdp_grids(layout: LayoutConfig) -> list[list[list[int]]]:
    """HSDP's 2D arrays of ranks, one per dp x cp group: row r is replica r's shard group (dp_shard x cp ranks:
    dp ranks r * dp_shard ... (r + 1) * dp_shard - 1, with their cp ranks), column j the replicas of shard j."""
    width = layout.zero_group
    return [[members[i:i + width] for i in range(0, len(members), width)]
            for members in axis_groups(layout, ("dp", "cp"))]  # dp-major, cp-minor: rows are dp blocks


def hsdp_expert_grids(layout: LayoutConfig) -> list[list[list[int]]]:
    """HSDP's 2D arrays for the routed experts: per HSDP array (`hsdp_grids`) and position j in an ep block, row r
    holds replica r's shard-group members at position j (every ep-th: those that hold the same experts, whose
    experts shard over them), column k the replicas of that shard. Their columns are columns of `hsdp_grids`.
    With whole experts under tp (etp = 1) the arrays of a pipeline stage's tp ranks are joined row by row (each row
    in rank order, which orders every row's members alike, so the columns stay replicas of one shard)."""
    ep = layout.ep
    grids = [[row[j::ep] for row in grid] for grid in hsdp_grids(layout) for j in range(ep)]
    if not layout.splits_tokens_over_tp:
        return grids
    joined: dict[tuple[int, int], list[list[int]]] = {}
    for index, grid in enumerate(grids):
        key = (coordinates(layout, grid[0][0])["pp"], index % ep)
        rows = joined.setdefault(key, [[] for _ in grid])
        for row, part in zip(rows, grid, strict=True):
            row.extend(part)
    return [[sorted(row) for row in grid] for grid in joined.values()]


@dataclass(frozen=True)
class Zero3Meshes:
    """Where ZeRO-3's `fully_shard` units of this rank shard (`ProcessGrid.zero3_meshes`)."""

    dense: DeviceMesh  # dp x cp, or HSDP's replicate x shard
    # the routed experts under ep: the edp ranks, or HSDP's replicate x (the shard group's ranks holding them);
    # None when each rank's experts stay whole (edp = 1) or without ep
    experts: DeviceMesh | None
    expert_parallel: bool
    replicas: int  # HSDP's replicas of each shard (1 without HSDP)


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
    hsdp_ranks: list[list[int]] = field(default_factory=list)  # HSDP: this rank's 2D array (`hsdp_grids`)
    hsdp_expert_ranks: list[list[int]] = field(default_factory=list)  # HSDP with ep: `hsdp_expert_grids`' one
    creations: int = 0  # communicator creations this rank made (`_create`)
    # the pipeline's point-to-point communicators (`pipeline_comm.edge_channel`), pp > 1
    pp_channels: list[ProcessGroup] = field(default_factory=list)
    # every group created so far, by its members (as every rank knows them): this rank's own, None for the others'
    _created: dict[tuple[int, ...], ProcessGroup | None] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cfg: Config) -> ProcessGrid:
        """Validate the layout for the initialised world, then create this rank's groups (module docstring)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        check_layout(cfg, world)  # the world that was initialised (a run started by torchrun directly, too)
        grid = cls(cfg.layout, rank, world, ranks=coordinates(cfg.layout, rank))
        for name, axes in GROUP_AXES.items():
            grid._add(name, axis_groups(cfg.layout, axes))
        # the pipeline's point-to-point communicators, one per edge direction and class of neighbour pairs
        # (`pipeline_comm.edge_channel`), each with the pp groups' members: made here, while every rank has made the
        # same number of groups (gloo names a group from that count and its members)
        pp_lists = axis_groups(cfg.layout, ("pp",))
        grid.pp_channels = [grid._create_fresh(pp_lists)
                            for _ in range(channel_count(cfg.layout.pp, cfg.layout.schedule == "interleaved"))]
        if cfg.layout.pp > 1:  # the first and last pipeline ranks, which hold the tied embedding's two copies
            grid._add("embed", [[members[0], members[-1]] for members in axis_groups(cfg.layout, ("pp",))])
        ep_lists, edp_lists = expert_groups(cfg.layout)
        grid._add("ep", ep_lists)
        grid._add("edp", edp_lists)
        if cfg.layout.dp_shard:  # HSDP: the shard groups (rows) and the replica groups (columns)
            grids = hsdp_grids(cfg.layout)
            grid._add("hsdp_shard", [row for g in grids for row in g])
            grid._add("hsdp_replicate", [list(col) for g in grids for col in zip(*g, strict=True)])
            grid.hsdp_ranks = next(g for g in grids if any(rank in row for row in g))
            if cfg.layout.experts_apart:  # the experts shard over the members of a shard group that hold them
                expert_grids = hsdp_expert_grids(cfg.layout)
                grid._add("hsdp_expert_shard", [row for g in expert_grids for row in g])
                grid.hsdp_expert_ranks = next(g for g in expert_grids if any(rank in row for row in g))
        return grid

    def _add(self, name: str, rank_lists: list[list[int]]) -> None:
        """Give this rank its group of `rank_lists` (every group of the name, as every rank computes them): an
        existing group with the same members, else one creation, on every rank, of the groups not made yet
        (`_create`). The groups of a size-1 axis are every rank's one-member group, made once for all such axes."""
        new = [members for members in rank_lists if tuple(members) not in self._created]
        if new:
            self._create(new)
        own = next((members for members in rank_lists if self.rank in members), None)
        if own is not None:  # (a middle pipeline rank has no embed group)
            self.groups[name], self.group_ranks[name] = self._created[tuple(own)], own

    def _create(self, rank_lists: list[list[int]]) -> None:
        """One communicator creation for groups that do not exist yet (the same list on every rank), recorded by
        their members."""
        own = next((members for members in rank_lists if self.rank in members), None)
        group = self._create_fresh(rank_lists)
        for members in rank_lists:
            self._created[tuple(members)] = group if members == own else None

    def _create_fresh(self, rank_lists: list[list[int]]) -> ProcessGroup | None:
        """One communicator creation for `rank_lists` (the same list on every rank), even where groups of the same
        members exist; this rank's group, None where it is in none."""
        if getattr(dist.group.WORLD, "bound_device_id", None) is not None:  # eager NCCL-like: one collective split
            self.creations += 1
            return dist.split_group(split_ranks=rank_lists)
        own = next((members for members in rank_lists if self.rank in members), None)
        if own is None:
            return None
        self.creations += 1  # only the members take part
        return dist.new_group(own, use_local_synchronization=True)

    def group(self, name: str) -> ProcessGroup:
        """This rank's process group called `name`: an axis or axis set of `GROUP_AXES` (tp, cp, dp, pp, dp_cp),
        ep and edp (expert parallel), embed (the first and last pipeline ranks, pp > 1), and under HSDP
        hsdp_shard, hsdp_replicate and hsdp_expert_shard."""
        if name not in self.groups:
            raise KeyError(f"process group {shown(name)} is not in this grid; it has {', '.join(self.groups)}")
        return self.groups[name]

    def size(self, axis: str) -> int:
        return len(self.group_ranks[axis])

    def zero3_meshes(self, device_type: str) -> Zero3Meshes:
        """ZeRO-3's meshes: the dense weights over dp x cp, the routed experts over the edp ranks (none to shard
        with edp = 1). Under HSDP both are 2D, replicate x shard: the shard groups of `hsdp_grids` (for the experts
        their members holding the same experts, `hsdp_expert_grids`), whose columns are the replicas."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        la = self.layout
        experts = None
        if la.dp_shard:
            def mesh_2d(shard: str, ranks: list[list[int]]) -> DeviceMesh:
                return DeviceMesh.from_group([self.group("hsdp_replicate"), self.group(shard)], device_type,
                                             mesh=torch.tensor(ranks), mesh_dim_names=("replicate", "shard"))

            dense = mesh_2d("hsdp_shard", self.hsdp_ranks)
            if la.experts_apart:
                experts = mesh_2d("hsdp_expert_shard", self.hsdp_expert_ranks)
        else:
            dense = DeviceMesh.from_group(self.group("dp_cp"), device_type)
            if la.experts_apart and self.size("edp") > 1:
                experts = DeviceMesh.from_group(self.group("edp"), device_type)
        return Zero3Meshes(dense, experts, la.experts_apart, la.zero_replicas)
