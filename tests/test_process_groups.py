"""`ProcessGrid.build` makes a handful of communicator creations per rank, whatever the world: one per distinct set
of groups of more than one rank, none per group of the world and no group per size-1 axis. Counted on rank K of a
4,096-rank world stood in for by `parallel.standin`, against the layout's coordinates worked out by hand."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import fivefold.parallel.standin as standin
from fivefold.config import build_config
from fivefold.parallel.mesh import ProcessGrid, expert_groups
from fivefold.parallel.standin import init_standin

TP, PP, DP, EP = 8, 8, 64, 8
WORLD = TP * PP * DP


def big_moe(**extra: str):
    return build_config(None, {"model.preset": "olmoe-1b-7b", "train.device": "cpu", "train.seq_len": "4096",
                               "train.global_batch_size": "1024", "layout.micro_batch_size": "1",
                               "data.path": "/nonexistent/process-groups", "layout.tp": str(TP),
                               "layout.pp": str(PP), "layout.dp": str(DP), "layout.ep": str(EP), **extra})


class Counted:
    """Counts the creations a rank asks of torch.distributed (`new_group`, `split_group`) and the stand-in groups
    that the backend constructs for them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.backends = 0
        for name in ("new_group", "split_group"):
            real = getattr(dist, name)
            monkeypatch.setattr(dist, name, self.wrap(real))
        counter = self

        class CountingGroup(standin.StandInGroup):
            def __init__(self, rank: int, size: int) -> None:
                super().__init__(rank, size)
                counter.backends += 1

        monkeypatch.setattr(standin, "StandInGroup", CountingGroup)

    def wrap(self, real):
        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        return counted


@pytest.mark.parametrize("rank", [0, 2741, WORLD - 1])
def test_4096_rank_layout_makes_at_most_16_creations_per_rank(rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = big_moe()
    init_standin(rank, WORLD)
    try:
        counted = Counted(monkeypatch)
        grid = ProcessGrid.build(cfg)
        # creating every group of every name on every rank (as before) is 6,784 calls here: tp 512, cp 4,096,
        # dp 64, pp 512, dp_cp 64, embed 512, ep 512, edp 512
        assert counted.calls == grid.creations <= 16, counted.calls
        assert counted.backends <= counted.calls
        # each group is the one the coordinates give (rank = ((pp * dp + d) * cp + c) * tp + t, cp = 1), and c10d
        # recorded it with those members
        tp_base = rank - rank % TP
        pp_r, rest = divmod(rank, DP * TP)
        expected = {
            "tp": list(range(tp_base, tp_base + TP)),
            "dp": [pp_r * DP * TP + d * TP + rank % TP for d in range(DP)],
            "pp": [p * DP * TP + rest for p in range(PP)],
            "cp": [rank],
        }
        if pp_r in (0, PP - 1):  # the first and last pipeline ranks' tied-embedding pair
            expected["embed"] = [rest, (PP - 1) * DP * TP + rest]
        else:
            assert "embed" not in grid.groups
        expected["dp_cp"] = expected["dp"]
        ep_lists, edp_lists = expert_groups(cfg.layout)
        expected["ep"] = next(m for m in ep_lists if rank in m)
        expected["edp"] = next(m for m in edp_lists if rank in m)
        assert expected["ep"] == expected["dp"][expected["dp"].index(rank) // EP * EP:][:EP]
        for name, members in expected.items():
            assert grid.group_ranks[name] == members, name
            assert dist.get_process_group_ranks(grid.group(name)) == members, name
            assert dist.get_world_size(grid.group(name)) == len(members)
        # dp and dp_cp (cp = 1) are one group; the size-1 axis has this rank's one-member group, not a group per rank
        assert grid.group("dp") is grid.group("dp_cp")
        # the pipeline's point-to-point communicators: one per edge direction and class of neighbour pairs (pp 8,
        # 1F1B: 2 x 2), each of this rank's pp group
        assert len(grid.pp_channels) == 4 and len(set(map(id, grid.pp_channels))) == 4
        assert all(dist.get_process_group_ranks(g) == expected["pp"] for g in grid.pp_channels)
        assert all(g is not grid.group("pp") for g in grid.pp_channels)
        # one creation per distinct group of this rank, and one per channel (on gloo and the stand-in only the
        # members take part)
        assert counted.calls == len({tuple(m) for m in expected.values()}) + 4
    finally:
        dist.destroy_process_group()


def test_hsdp_and_context_parallel_groups_on_a_large_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """tp8 cp2 dp32 (HSDP, shards of 8) pp8: every group named, at most 16 creations."""
    cfg = build_config(None, {"model.preset": "olmoe-1b-7b", "train.device": "cpu", "train.seq_len": "4096",
                              "train.global_batch_size": "256", "layout.micro_batch_size": "1",
                              "data.path": "/nonexistent/process-groups", "layout.tp": "8", "layout.cp": "2",
                              "layout.dp": "32", "layout.pp": "8", "layout.zero": "3", "layout.dp_shard": "8"})
    init_standin(1234, 8 * 2 * 32 * 8)
    try:
        counted = Counted(monkeypatch)
        grid = ProcessGrid.build(cfg)
        assert counted.calls == grid.creations <= 16
        for name, members in grid.group_ranks.items():
            assert 1234 in members and dist.get_process_group_ranks(grid.group(name)) == members, name
        assert [len(grid.group_ranks[n]) for n in ("tp", "cp", "dp", "pp", "dp_cp", "hsdp_shard", "hsdp_replicate")] \
            == [8, 2, 32, 8, 64, 16, 4]
        assert [dist.get_process_group_ranks(g) for g in grid.pp_channels] == [grid.group_ranks["pp"]] * 4
    finally:
        dist.destroy_process_group()
