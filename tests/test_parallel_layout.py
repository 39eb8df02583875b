"""The process grid's rank mapping and the refusal of every bad layout, before any process group exists."""

from __future__ import annotations

import itertools

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, LayoutConfig, build_config
from fivefold.layout import check_layout
from fivefold.parallel.mesh import axis_groups, coordinates, expert_groups, rank_of


def test_ranks_are_laid_out_tp_innermost_then_cp_dp_pp():
    layout = LayoutConfig(dp=2, tp=2, pp=3, cp=2)
    # the order written out by hand: pp outermost, tp innermost
    expected = list(itertools.product(range(3), range(2), range(2), range(2)))  # (pp, dp, cp, tp)
    for rank, (pp, dp, cp, tp) in enumerate(expected):
        assert coordinates(layout, rank) == {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        assert rank_of(layout, pp, dp, cp, tp) == rank
    assert axis_groups(layout, ("tp",))[:2] == [[0, 1], [2, 3]]
    assert axis_groups(layout, ("cp",))[0] == [0, 2]
    assert axis_groups(layout, ("dp",))[0] == [0, 4]
    assert axis_groups(layout, ("pp",))[0] == [0, 8, 16]
    assert axis_groups(layout, ("dp", "cp"))[0] == [0, 2, 4, 6]
    # every axis partitions the world
    for axes in (("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp")):
        assert sorted(r for g in axis_groups(layout, axes) for r in g) == list(range(24))


def test_expert_parallel_folds_over_dp_times_cp():
    layout = LayoutConfig(dp=2, cp=2, tp=2, ep=2, etp=2)  # experts split over tp: each tp rank its own ep groups
    ep, edp = expert_groups(layout)
    # the dp x cp group of tp rank 0 is [0, 2, 4, 6]: ep blocks of 2, replicas at the same block position
    assert ep[:2] == [[0, 2], [4, 6]] and edp[:2] == [[0, 4], [2, 6]]
    assert sorted(r for g in ep for r in g) == list(range(8))
    assert sorted(r for g in edp for r in g) == list(range(8)) and len(edp) == 4


def test_whole_experts_reduce_over_the_tp_ranks_too():
    """etp = 1 (the default): the tp ranks route different tokens and hold the same experts, so each edp group joins
    the replicas of every tp rank of its pipeline stage; the ep groups stay inside one tp rank."""
    layout = LayoutConfig(dp=2, cp=2, tp=2, ep=2, pp=2)
    ep, edp = expert_groups(layout)
    assert ep[:2] == [[0, 2], [4, 6]]
    assert edp == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert len(edp[0]) == layout.expert_zero_group == 4
    # ep = 1: the experts of every rank of a stage are the same, reduced over tp x dp x cp
    assert expert_groups(LayoutConfig(dp=2, tp=2))[1] == [[0, 1, 2, 3]]


def config(**fields: str):
    return build_config(None, {"train.global_batch_size": "8", **{k.replace("__", "."): v for k, v in fields.items()}})


def refused(cfg, world: int) -> str:
    with pytest.raises(ConfigError) as e:
        cfg.validate()
        check_layout(cfg, world)
    return str(e.value)


def test_product_must_equal_the_world_size():
    msg = refused(config(layout__dp="2", layout__tp="2"), 2)
    assert "2 x 2 x 1 x 1 = 4 does not equal the world size 2" in msg and "layout.dp = 1" in msg


@pytest.mark.parametrize("model, tp, field", [
    ({"model.n_heads": "4", "model.n_kv_heads": "4"}, 3, "model.n_heads = 4"),
    ({"model.n_heads": "8", "model.n_kv_heads": "2", "model.hidden": "128"}, 4, "model.n_kv_heads = 2"),
    ({"model.n_heads": "4", "model.n_kv_heads": "4", "model.ffn": "386"}, 4, "model.ffn = 386"),
    ({"model.vocab_size": "2049"}, 2, "model.vocab_size = 2049"),
])
def test_tp_must_divide_heads_kv_heads_ffn_and_vocab(model, tp, field):
    cfg = build_config(None, {**model, "layout.tp": str(tp)})
    msg = refused(cfg, tp)
    assert f"layout.tp = {tp} does not divide {field}" in msg and "valid tp" in msg


def test_global_batch_must_divide_by_dp_times_micro_batch():
    msg = refused(config(layout__dp="2", layout__micro_batch_size="3"), 2)
    assert "micro_batch_size = 3" in msg and "[1, 2, 4]" in msg
    cfg = config(layout__dp="2", layout__micro_batch_size="3")
    cfg.train.global_batch_size = 9  # not even divisible by dp
    assert "global_batch_size = 9 is not divisible by layout.dp = 2" in refused(cfg, 2)


def test_zero_needs_data_parallel():
    msg = refused(config(layout__zero="2", layout__tp="2"), 2)
    assert "layout.zero = 2 with layout.dp = 1" in msg and "layout.zero = 0, or layout.dp >= 2" in msg


@pytest.mark.parametrize("fields, world, expected", [
    ({"layout__vpp": "2"}, 1, "layout.vpp = 2 needs pipeline parallel"),
    ({"layout__sp": "true", "layout__dp": "2"}, 2, "layout.sp = true needs tensor parallel"),
    ({"layout__sp": "true", "layout__tp": "2", "train__seq_len": "127"}, 2,
     "train.seq_len = 127 is not divisible by layout.tp = 2"),
])
def test_unsupported_combinations_are_refused(fields, world, expected):
    assert expected in refused(config(**fields), world)


def test_cli_refuses_a_bad_layout_before_starting_processes(capsys, tmp_path):
    code = main(["train", "--nproc", "3", "--layout.dp", "2", "--run-dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not equal the world size 3" in err and "layout.dp = 3" in err
    assert not (tmp_path / "run").exists()


MOE = {"model__n_experts": "4", "model__top_k": "2"}


@pytest.mark.parametrize("fields, world, expected", [
    # cp cuts each sequence into 2*cp chunks
    ({"layout__cp": "2", "train__seq_len": "126"}, 2,
     "train.seq_len = 126 cannot be split for context parallel with cp = 2: the sequence is cut into 2*cp = 4 "
     "equal chunks (rank r keeps chunks r and 3-r), so the length must be a multiple of 4; nearest valid "
     "lengths: 124, 128"),
    # cp x tp with sequence parallel: the cp-local length is split again over tp
    ({"layout__cp": "2", "layout__tp": "4", "layout__sp": "true", "train__seq_len": "36", "model__n_kv_heads": "4"}, 8,
     "train.seq_len = 36 (the cp-local length train.seq_len / layout.cp = 18) is not divisible by layout.tp = 4, "
     "which sequence parallel (layout.sp = true) needs; nearest valid seq_len: [32, 40]"),
    # ep
    ({"layout__ep": "2", "layout__dp": "2"}, 2,
     "layout.ep = 2 on a dense model (model.n_experts = 0): expert parallel shards the experts of "
     "mixture-of-experts layers; use layout.ep = 1, or an MoE model"),
    ({"layout__ep": "3", "layout__dp": "3", "train__global_batch_size": "9", **MOE}, 3,
     "layout.ep = 3 does not divide model.n_experts = 4: each ep rank holds n_experts / ep whole experts; "
     "valid ep for this model: [1, 2, 4]"),
    ({"layout__ep": "4", "layout__dp": "2", **MOE}, 2,
     "layout.ep = 4 does not divide layout.dp x layout.cp = 2 x 1 = 2: expert parallel folds over the dp x cp "
     "ranks (it adds no ranks), so each dp x cp group must split into blocks of ep ranks; valid ep for this "
     "layout and model: [1, 2]"),
    ({"layout__ep": "4", "layout__dp": "2", "layout__pp": "2", "layout__zero": "3", **MOE}, 4,
     "layout.ep = 4 does not divide layout.dp x layout.cp = 2 x 1 = 2"),
    # ZeRO needs ranks that reduce gradients: dp or cp
    ({"layout__zero": "1", "layout__tp": "2"}, 2, "layout.zero = 1 with layout.dp = 1 and layout.cp = 1"),
])
def test_bad_context_and_expert_parallel_layouts_are_refused(fields, world, expected):
    assert expected in refused(config(**fields), world)


def test_context_and_expert_parallel_layouts_that_work_are_accepted():
    for fields, world in [
        ({"layout__cp": "2", "train__seq_len": "128"}, 2),
        ({"layout__cp": "2", "layout__tp": "2", "layout__sp": "true", "train__seq_len": "128"}, 4),
        ({"layout__cp": "2", "layout__zero": "1"}, 2),  # ZeRO shards over dp x cp
        ({"layout__ep": "2", "layout__cp": "2", **MOE}, 2),  # ep folds over cp too
        ({"layout__ep": "2", "layout__dp": "2", "layout__zero": "2", **MOE}, 2),
    ]:
        cfg = config(**fields)
        cfg.validate()
        check_layout(cfg, world)


def test_pp_above_the_layer_count_is_refused():
    msg = refused(config(layout__pp="8", model__n_layers="4"), 8)
    assert "layout.pp = 8 exceeds model.n_layers = 4" in msg and "use layout.pp <= 4" in msg


def test_a_schedule_needing_more_micro_batches_is_refused():
    # dualpipev needs 2 pp micro-batches; the whole batch in one micro-batch gives 1
    msg = refused(config(layout__pp="2", layout__schedule="dualpipev", model__n_layers="4"), 2)
    assert "layout.schedule = dualpipev with layout.pp = 2 needs at least 4 micro-batches per step" in msg
    assert "= 8 / (1 x 8) = 1" in msg and "use layout.micro_batch_size in [2, 1]" in msg


def test_interleaved_needs_a_multiple_of_pp_micro_batches_and_enough_layers():
    cfg = config(layout__pp="2", layout__schedule="interleaved", layout__vpp="2", model__n_layers="4",
                 layout__micro_batch_size="2")
    cfg.train.global_batch_size = 6  # 3 micro-batches
    msg = refused(cfg, 2)
    assert "needs at least 2 micro-batches per step, a multiple of layout.pp = 2" in msg
    assert "use layout.micro_batch_size in [3, 1]" in msg
    msg = refused(config(layout__pp="2", layout__schedule="interleaved", layout__vpp="4", model__n_layers="4",
                         layout__micro_batch_size="2"), 2)
    assert "layout.pp x layout.vpp = 2 x 4 = 8 stages exceed model.n_layers = 4" in msg
    assert "use layout.vpp in [1, 2]" in msg


def test_vpp_without_the_interleaved_schedule_is_refused():
    msg = refused(config(layout__pp="2", layout__vpp="2", model__n_layers="4"), 2)
    assert "layout.vpp = 2 (stages per rank) applies to the interleaved schedule only" in msg
    assert "layout.schedule = interleaved" in msg


def test_zero3_with_pipeline_parallel_is_accepted_with_and_without_expert_parallel():
    from fivefold.layout import expert_parallel_problem, pipeline_problem

    for fields, world in [
        ({"layout__pp": "2", "layout__dp": "2", "layout__zero": "3"}, 4),
        ({"layout__pp": "2", "layout__dp": "2", "layout__ep": "2", "layout__zero": "3", **MOE}, 4),  # edp 1
        ({"layout__pp": "2", "layout__dp": "4", "layout__ep": "2", "layout__zero": "3", **MOE}, 8),  # edp 2
    ]:
        cfg = config(**fields)
        cfg.validate()
        check_layout(cfg, world)
        assert expert_parallel_problem(cfg.model, cfg.layout) is None
        assert pipeline_problem(cfg.model, cfg.layout, cfg.train.seq_len, cfg.train.global_batch_size) is None
    # the other rules still apply to the combination
    msg = refused(config(layout__pp="2", layout__dp="2", layout__ep="2", layout__zero="3", layout__vpp="2",
                         model__n_layers="4", **MOE), 4)
    assert "layout.vpp = 2 (stages per rank) applies to the interleaved schedule only" in msg


def test_a_bad_explicit_stage_split_is_refused():
    for split in ("3,2", "4,0", "1,1,2"):
        msg = refused(config(layout__pp="2", model__n_layers="4", layout__stage_layers=split), 2)
        assert "must give each of the 2 pipeline stages at least one block, 4 blocks in all" in msg
        assert "the compute-balanced split is [3, 1]" in msg, msg
    msg = refused(config(layout__stage_layers="2,2", model__n_layers="4"), 1)
    assert "layout.stage_layers = [2, 2] splits the blocks over pipeline stages, but layout.pp = 1" in msg


def test_pipeline_layouts_that_work_are_accepted():
    for fields, world in [
        ({"layout__pp": "2", "model__n_layers": "4", "layout__stage_layers": "1,3"}, 2),
        ({"layout__pp": "2", "layout__schedule": "interleaved", "layout__vpp": "2", "model__n_layers": "4",
          "layout__micro_batch_size": "4"}, 2),
        ({"layout__pp": "2", "layout__dp": "2", "layout__zero": "2", "layout__schedule": "dualpipev",
          "model__n_layers": "4", "layout__micro_batch_size": "1"}, 4),
        ({"layout__pp": "4", "layout__tp": "2", "model__n_layers": "4"}, 8),
    ]:
        cfg = config(**fields)
        cfg.validate()
        check_layout(cfg, world)


def test_cli_refuses_a_bad_expert_layout_before_starting_processes(capsys, tmp_path):
    code = main(["train", "--nproc", "2", "--layout.dp", "2", "--layout.ep", "2", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert "layout.ep = 2 on a dense model" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_grid_group_names_each_group_and_refuses_an_unknown_name():
    """`ProcessGrid.group(name)` is the one accessor: it returns the group the grid holds under that name (no other
    attribute reaches a group) and names the groups it has for a wrong name."""
    from fivefold.parallel.mesh import ProcessGrid

    tp, dp_cp = object(), object()  # stand-ins: no process group is created here
    grid = ProcessGrid(LayoutConfig(dp=2, tp=2), 0, 4, groups={"tp": tp, "dp_cp": dp_cp})
    assert grid.group("tp") is tp and grid.group("dp_cp") is dp_cp
    assert not hasattr(grid, "tp_group") and not hasattr(grid, "grad_group")
    with pytest.raises(KeyError, match="'edp' is not in this grid; it has tp, dp_cp"):
        grid.group("edp")


def test_hsdp_expert_arrays_join_the_tp_ranks_with_whole_experts():
    """HSDP x ep with whole experts under tp: each expert array's rows (shard groups) hold the members of both tp
    ranks at one ep position, as many as `expert_zero_group`; its columns are replica groups of the dense arrays (so
    fully_shard's replicate dimension all-reduces each shard over its replicas), and every rank is in one row."""
    from fivefold.parallel.mesh import hsdp_expert_grids, hsdp_grids

    layout = LayoutConfig(dp=4, tp=2, ep=2, pp=2, zero=3, dp_shard=2)
    replicas = {tuple(col) for g in hsdp_grids(layout) for col in zip(*g, strict=True)}
    grids = hsdp_expert_grids(layout)
    ep_blocks = expert_groups(layout)[0]
    position = {r: block.index(r) for block in ep_blocks for r in block}
    assert len(grids) == layout.pp * layout.ep
    for grid in grids:
        assert len(grid) == layout.zero_replicas
        for row in grid:
            assert len(row) == layout.expert_zero_group == 2 and row == sorted(row)
            assert len({position[r] for r in row}) == 1 and len({r % layout.tp for r in row}) == layout.tp
        assert all(tuple(col) in replicas for col in zip(*grid, strict=True)), grid
    assert sorted(r for g in grids for row in g for r in row) == list(range(layout.world_size))


def test_expert_tensor_parallel_degree_is_one_or_tp():
    moe = {"model__n_experts": "4", "model__top_k": "2"}
    msg = refused(config(layout__tp="2", layout__etp="4", **moe), 2)
    assert "layout.etp = 4 must be 1" in msg and "layout.tp = 2" in msg
    # whole experts split each sequence over the tp ranks: the sequence must divide (without SP too)
    msg = refused(config(layout__tp="2", train__seq_len="33", **moe), 2)
    assert "train.seq_len = 33 is not divisible by layout.tp = 2" in msg and "layout.etp = 2" in msg
    config(layout__tp="2", layout__etp="2", train__seq_len="33", **moe).validate()  # split experts route it all
    check_layout(config(layout__tp="2", layout__etp="2", train__seq_len="33", **moe), 2)
