"""HSDP in the planner (frameworks that run it: fivefold, torchtitan): ZeRO-3 sharded inside groups of
dp_shard x cp ranks and replicated across dp / dp_shard of them. References: the states of FSDP over the shard
group alone (the same shards), the gathers of an FSDP job on one node of the shard group's ranks (the same
collective), and the closed form of the replica all-reduce. The engine's HSDP against one process:
tests/test_parallel_equivalence.py and tests/test_checkpoint_reshard.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.planner import comm
from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import FIVEFOLD, Layout, parse_layout
from fivefold.planner.memory import model_state_bytes, rank_params
from fivefold.planner.profile import all_frameworks
from fivefold.planner.time import step_time
from fivefold.presets import get_preset

TORCHTITAN = all_frameworks()["torchtitan"]


def hsdp_reduction(grads: float, shards: int, stride: int, replicas: int, hw, n_layers: int,
                   micro_batches: int) -> float:
    """The closed form of ZeRO-3's gradient reduction of `grads` bytes per micro-batch, in units of a block (at
    least a DP bucket): a reduce-scatter over the `shards` ranks `stride` apart, then, with replicas, an all-reduce of
    the shard over the replicas (`shards x stride` apart)."""
    unit = max(TORCHTITAN.dp_bucket_mib * 2**20, grads / n_layers)
    t = comm.reduce_scatter(grads, shards, stride, hw, unit)
    if replicas > 1:
        t += comm.all_reduce(grads / shards, replicas, stride * shards, hw, unit / shards)
    return t * micro_batches


@pytest.mark.parametrize("dp,shard,cp", [(16, 4, 1), (16, 8, 1), (8, 2, 2)])
def test_hsdp_states_are_those_of_fsdp_over_the_shard_group(dp, shard, cp):
    cfg = get_preset("llama3-8b")
    hsdp = Layout(dp=dp, cp=cp, zero=3, dp_shard=shard)
    fsdp_of_the_group = Layout(dp=shard, cp=cp, zero=3)
    assert hsdp.zero_group == shard * cp and hsdp.zero_replicas == dp // shard
    for fw in (TORCHTITAN, FIVEFOLD):
        assert model_state_bytes(cfg, hsdp, fw, seq=4096) == model_state_bytes(cfg, fsdp_of_the_group, fw, seq=4096)
        assert model_state_bytes(cfg, hsdp, fw, seq=4096)["parameters"] > model_state_bytes(
            cfg, Layout(dp=dp, cp=cp, zero=3), fw, seq=4096)["parameters"]


def test_hsdp_gathers_inside_a_node_and_reduces_across_replicas():
    """dp16 on 2 nodes of 8, shard 8: each block is gathered over the 8 ranks of a node, as FSDP dp8 on one node
    gathers it; the gradients are reduce-scattered over those 8 and each shard all-reduced over the 2 replicas."""
    # nothing hidden behind compute, so that the collectives show whole
    bare = dataclasses.replace(get_cluster("h100"), comm_overlap=0.0)
    cfg = get_preset("llama3-8b")
    lay = Layout(dp=16, zero=3, dp_shard=8, micro_batch_size=1, grad_accum_steps=4)
    one_node = Layout(dp=8, zero=3, micro_batch_size=1, grad_accum_steps=4)
    fsdp = dataclasses.replace(lay, dp_shard=0)
    t_hsdp, t_node, t_fsdp = (step_time(cfg, 8192, la, TORCHTITAN, bare) for la in (lay, one_node, fsdp))
    assert t_hsdp.parts["zero_gather"] == pytest.approx(t_node.parts["zero_gather"], rel=1e-9)
    assert t_fsdp.parts["zero_gather"] > t_hsdp.parts["zero_gather"]  # across nodes, over 16 ranks
    # the reduction: per block, a reduce-scatter over the node's 8 ranks and an all-reduce of the shard over the
    # 2 replicas (a rank 8 apart, on the other node), for each micro-batch
    grads = rank_params(cfg, lay, "first", seq=4096).total * TORCHTITAN.grad_bytes
    expected = hsdp_reduction(grads, 8, 1, 2, bare, cfg.n_layers, 4)
    assert t_hsdp.parts["dp_comm_exposed"] == pytest.approx(expected)
    assert t_fsdp.parts["dp_comm_exposed"] == pytest.approx(hsdp_reduction(grads, 16, 1, 1, bare, cfg.n_layers, 4))


def test_hsdp_with_expert_parallel_shards_the_experts_inside_the_shard_group():
    """dp16 x ep4 on 2 nodes of 8, shard 8: the dense weights as FSDP dp8 holds them; each ep rank's experts shard
    over the 2 ranks of the node that hold them (FSDP dp8 x ep4's edp) and are replicated across the 2 nodes. The
    experts' gradients: reduce-scatter over those 2 ranks (4 apart), then each shard all-reduced over the 2
    replicas (8 apart)."""
    bare = dataclasses.replace(get_cluster("h100"), comm_overlap=0.0)
    cfg = get_preset("olmoe-1b-7b")
    lay = Layout(dp=16, ep=4, zero=3, dp_shard=8, micro_batch_size=1, grad_accum_steps=4)
    assert lay.expert_zero_group == 2 and lay.edp == 4
    assert model_state_bytes(cfg, lay, TORCHTITAN, seq=4096) == model_state_bytes(cfg, Layout(dp=8, ep=4, zero=3),
                                                                         TORCHTITAN, seq=4096)
    t = step_time(cfg, 4096, lay, TORCHTITAN, bare).parts["dp_comm_exposed"]
    rp = rank_params(cfg, lay, "first", seq=4096)
    expected_experts = hsdp_reduction(rp.expert * TORCHTITAN.grad_bytes, 2, 4, 2, bare, cfg.n_layers, 4)
    expected_dense = hsdp_reduction(rp.dense * TORCHTITAN.grad_bytes, 8, 1, 2, bare, cfg.n_layers, 4)
    assert t == pytest.approx(expected_dense + expected_experts)


def test_the_search_tries_hsdp_where_the_framework_runs_it(capsys, tmp_path):
    args = ["plan", "--model", "llama3-8b", "--nodes", "2", "--seq-len", "8192", "--global-batch", "256K", "--json"]
    for framework in ("torchtitan", "fivefold"):
        assert main([*args, "--framework", framework]) == 0
        layouts = [c["layout"] for c in json.loads(capsys.readouterr().out)["candidates"]]
        hsdp = [la for la in layouts if la["dp_shard"]]
        assert hsdp and all(la["zero"] == 3 and la["dp"] % la["dp_shard"] == 0 and la["ep"] == 1 for la in hsdp)
        # one node's ranks per shard group: dp_shard x cp x tp = 8
        assert all(la["dp_shard"] * la["cp"] * la["tp"] == 8 for la in hsdp)
    assert main([*args, "--framework", "nanotron"]) == 0  # nanotron has no HSDP
    assert not any(c["layout"]["dp_shard"] for c in json.loads(capsys.readouterr().out)["candidates"])
    # a written HSDP layout is a config fivefold's engine runs: it keeps dp_shard and validates
    out = tmp_path / "hsdp.toml"
    from fivefold.cli.plan import write_config
    from fivefold.config import build_config

    lay = parse_layout("dp=32,zero=3,dp_shard=8,mbs=1,recompute=selective", 32)
    write_config(str(out), get_preset("llama3-8b"), lay, 8192, 32, "bf16", 4, 8)
    written = build_config(out)
    assert written.layout.dp_shard == 8 and written.layout.zero == 3
    assert main(["train", "--config", str(out), "--dry-run", "--gpu", "h100"]) == 0
    assert "zero 3, HSDP: 4 replicas of shard groups of 8" in capsys.readouterr().out


def test_hsdp_layouts_are_checked(capsys):
    """By the engine's rule book (`fivefold.layout.hsdp_problem`), which `fivefold train` applies too."""
    with pytest.raises(ConfigError, match="needs layout.zero = 3"):
        parse_layout("dp=16,zero=1,dp_shard=8", 64)
    with pytest.raises(ConfigError, match=r"must divide layout.dp = 16 and be smaller.*valid dp_shard: \[1, 2, 4, 8\]"):
        parse_layout("dp=16,zero=3,dp_shard=6", 64)
    with pytest.raises(ConfigError, match="must divide layout.dp = 16 and be smaller"):
        parse_layout("dp=16,zero=3,dp_shard=16", 64)
    with pytest.raises(ConfigError, match=r"dp_shard x layout.cp = 2 x 1 must be a multiple of layout.ep = 4.*"
                                          r"valid dp_shard: \[4, 8\]"):
        parse_layout("dp=16,ep=4,zero=3,dp_shard=2", 64)
    assert parse_layout("dp=16,ep=4,zero=3,dp_shard=8", 64).expert_zero_group == 2  # with ep it runs
    assert parse_layout("dp=8,pp=2,zero=3,dp_shard=4", 64).zero_replicas == 2  # with pp it runs
    assert parse_layout("dp=16,zero=3,dp_shard=8", 64).short().startswith("dp16 tp1 pp1 z3 hsdp8 ")
    base = ["plan", "--model", "llama3-8b", "--nodes", "2", "--global-batch", "256K", "--seq-len", "4096",
            "--layout", "dp=16,zero=3,dp_shard=8"]
    assert main([*base, "--framework", "nanotron"]) == 2
    assert "the nanotron engine does not run" in capsys.readouterr().err
    assert main([*base, "--framework", "torchtitan"]) == 0
    assert main(base) == 0  # fivefold


def test_hsdp_is_its_own_family_and_not_the_fsdp_baseline(capsys):
    args = ["plan", "--model", "llama3-8b", "--nodes", "4", "--seq-len", "8192", "--global-batch", "256K",
            "--framework", "torchtitan"]
    assert main([*args, "--top", "20"]) == 0
    out = capsys.readouterr().out
    assert any(" z3 hsdp" in line and "HSDP (4 x shard 8)" in line for line in out.splitlines())
    from fivefold.planner.explain import BASELINES
    from fivefold.planner.search import estimate

    hw = get_cluster("h100")
    hsdp, fsdp = (estimate(get_preset("llama3-8b"), 8192, Layout(dp=32, zero=3, dp_shard=s), TORCHTITAN, hw)
                  for s in (8, 0))
    assert BASELINES["FSDP"](fsdp) and not BASELINES["FSDP"](hsdp)


def test_plan_scaling_with_an_hsdp_layout(capsys):
    """A fixed HSDP layout keeps its shard degree as dp grows; where one shard group holds every dp rank (one
    node) it is plain FSDP; nanotron's engine refuses it."""
    args = ["plan", "scaling", "--model", "llama3-8b", "--nodes", "1,2,4", "--seq-len", "8192", "--global-batch",
            "128K", "--weak", "--layout", "dp=16,zero=3,dp_shard=8,mbs=1,recompute=selective", "--json"]
    assert main([*args, "--framework", "torchtitan"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    shards = [p["layout_knobs"]["dp_shard"] for p in points]
    assert shards == [0, 8, 8] and [p["layout_knobs"]["dp"] for p in points] == [8, 16, 32]
    assert main([*args, "--framework", "nanotron"]) == 2
    assert "is HSDP, which the nanotron engine does not run; frameworks that do: fivefold" in capsys.readouterr().err
