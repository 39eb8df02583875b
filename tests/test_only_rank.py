"""`fivefold train --only-rank K`: rank K of a layout alone, every other rank stood in for (`parallel.standin`).

What proves it: the state bytes (parameters, gradients, optimizer) that rank K holds alone equal those the same
rank holds in the real multi-process run (gloo, `tests.distributed.run_ranks`) and the closed form of the
layout's sharding rule (`planner.memory.model_state_bytes`, counted from the parameter shapes), for every
dimension and schedule; every rank of a small layout runs; each collective the engine uses goes through the
stand-in group with the documented result, so a PyTorch release that calls another method on the group fails
here; MoE routing is balanced under --only-rank and only there.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.distributed import adopt_environment, fresh_process_context, run_ranks

from fivefold.accelerators import HARDWARE
from fivefold.cli import main
from fivefold.config import build_config
from fivefold.parallel.pipeline import stage_layer_counts
from fivefold.parallel.standin import StandInGroup, init_standin
from fivefold.planner.layout import FIVEFOLD_CPU
from fivefold.planner.memory import model_state_bytes
from fivefold.planner.predict import layout_of
from fivefold.tools.only_rank import measure_rank, planner_for_rank, rank_description

BASE = {"train.device": "cpu", "train.dtype": "fp32", "train.seq_len": "32", "train.global_batch_size": "8",
        "train.threads": "1", "data.path": "/nonexistent/only-rank-test"}
DENSE = {"model.preset": "tiny"}
MOE = {"model.preset": "tiny-moe"}

# every dimension, ZeRO stage and pipeline schedule, and their combinations, on at most 4 ranks
LAYOUTS: dict[str, dict[str, str]] = {
    "dp2-zero0": {**DENSE, "layout.dp": "2", "layout.zero": "0"},
    "dp2-zero1": {**DENSE, "layout.dp": "2", "layout.zero": "1"},
    "dp2-zero2": {**DENSE, "layout.dp": "2", "layout.zero": "2"},
    "dp4-zero3": {**DENSE, "layout.dp": "4", "layout.zero": "3"},
    "hsdp-dp4-shard2": {**DENSE, "layout.dp": "4", "layout.zero": "3", "layout.dp_shard": "2"},
    "tp2-sp": {**DENSE, "layout.tp": "2", "layout.sp": "true"},
    "cp2": {**DENSE, "layout.cp": "2"},
    "pp2-afab": {**DENSE, "layout.pp": "2", "layout.schedule": "afab", "layout.micro_batch_size": "2"},
    "pp2-1f1b": {**DENSE, "layout.pp": "2", "layout.schedule": "1f1b", "layout.micro_batch_size": "2"},
    "pp2-interleaved": {**DENSE, "layout.pp": "2", "layout.schedule": "interleaved", "layout.vpp": "2",
                        "layout.micro_batch_size": "2"},
    "pp2-zero-bubble": {**DENSE, "layout.pp": "2", "layout.schedule": "zero-bubble", "layout.micro_batch_size": "2"},
    "pp2-dualpipev": {**DENSE, "layout.pp": "2", "layout.schedule": "dualpipev", "layout.micro_batch_size": "2"},
    "ep2-dp2": {**MOE, "layout.dp": "2", "layout.ep": "2"},
    "ep2-dp2-zero3": {**MOE, "layout.dp": "2", "layout.ep": "2", "layout.zero": "3"},
    "tp2-pp2": {**DENSE, "layout.tp": "2", "layout.pp": "2", "layout.micro_batch_size": "4"},
    "dp2-cp2-zero1": {**DENSE, "layout.dp": "2", "layout.cp": "2", "layout.zero": "1"},
    "cp2-tp2-sp-moe": {**MOE, "layout.cp": "2", "layout.tp": "2", "layout.sp": "true"},
    "pp2-dp2-ep2-zero3-moe": {**MOE, "layout.pp": "2", "layout.dp": "2", "layout.ep": "2", "layout.zero": "3",
                              "layout.micro_batch_size": "2"},
    "pp2-dp2-zero2-recompute": {**DENSE, "layout.pp": "2", "layout.dp": "2", "layout.zero": "2",
                                "layout.recompute": "selective", "layout.micro_batch_size": "2"},
}
FAST = ("dp4-zero3", "tp2-pp2", "ep2-dp2-zero3", "pp2-zero-bubble", "cp2-tp2-sp-moe")


def config(name: str):
    return build_config(None, {**BASE, **LAYOUTS[name]})


def closed_form(cfg, rank: int) -> dict[str, int]:
    """The rank's bytes by the sharding rule, counted from the parameter shapes (fp32: 4 + 4 + 8 per parameter,
    sharded by ZeRO over its group; the engine's balanced stage split given, as the engine computes it)."""
    lay = layout_of(cfg)
    if lay.pp > 1:
        lay.stage_layers = stage_layer_counts(cfg)
    which = rank_description(cfg, rank)["planner_rank"]
    states = model_state_bytes(cfg.model, lay, FIVEFOLD_CPU, which, seq=cfg.train.seq_len)
    return {"parameters": states["parameters"], "gradients": states["gradients"], "optimizer": states["optimizer"]}


def real_run_bytes(rank: int, world: int, name: str) -> dict[str, int]:
    """One training step of the real run on `world` gloo ranks: this rank's bytes, measured as --only-rank does
    (parameters and gradients before the optimizer step, the optimizer's state after it)."""
    from fivefold.train.build import build_engine
    from fivefold.train.loop import split_micro_batches

    cfg = config(name)
    engine = build_engine(cfg, torch.device("cpu"))
    rows = cfg.train.global_batch_size // engine.dp_size
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.train.seq_len + 1),
                           generator=torch.Generator().manual_seed(engine.dp_rank))
    batches = split_micro_batches(tokens[:, :-1], tokens[:, 1:], cfg.micro_batch_size, engine.device)
    loss = engine.forward_backward(batches, cfg.train.global_batch_size * cfg.train.seq_len)
    held = engine.state_bytes()
    engine.optimizer_step(loss)
    held["optimizer"] = engine.state_bytes()["optimizer"]
    return held


def standin_bytes(name: str, rank: int) -> dict[str, int]:
    measured = measure_rank(config(name), rank, steps=1)
    assert len(measured["steps"]) == 1 and measured["steps"][0]["seconds"] > 0
    return measured["held_bytes"]


def every_rank_alone(name: str) -> list[dict[str, int]]:
    """Each rank of the layout alone: one after another in this process, or under ZeRO-3 (whose DeviceMeshes PyTorch
    remembers, group names included, across worlds) each in a process of its own, as the command line runs it."""
    world = config(name).layout.world_size
    if config(name).layout.zero != 3:
        return [standin_bytes(name, rank) for rank in range(world)]
    with ProcessPoolExecutor(2, mp_context=fresh_process_context(), max_tasks_per_child=1,
                             initializer=adopt_environment, initargs=(dict(os.environ),)) as pool:
        return list(pool.map(standin_bytes, [name] * world, range(world)))


def check_every_rank(name: str, against_real_run: bool) -> None:
    cfg = config(name)
    world = cfg.layout.world_size
    real = run_ranks(world, real_run_bytes, name) if against_real_run else None
    for rank, alone in enumerate(every_rank_alone(name)):
        assert alone == closed_form(cfg, rank), f"{name}, rank {rank}"
        if real is not None:
            assert alone == real[rank], f"{name}, rank {rank}: alone {alone}, in the real run {real[rank]}"


@pytest.mark.parametrize("name", FAST)
def test_every_rank_alone_holds_the_closed_form_bytes(name):
    check_every_rank(name, against_real_run=False)


def test_every_rank_alone_holds_what_it_holds_in_the_real_run():
    check_every_rank("tp2-pp2", against_real_run=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in FAST])
def test_every_layout_every_rank_alone_holds_the_closed_form_bytes(name):
    check_every_rank(name, against_real_run=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_every_rank_alone_holds_what_it_holds_in_the_real_run(name):
    check_every_rank(name, against_real_run=True)


# --- the stand-in group: every collective the engine uses ---------------------------------------------------


@pytest.fixture
def standin_world():
    init_standin(1, 4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_standin_group_serves_each_collective_the_engine_uses(standin_world):
    """The operations of the engine (tensor, context, expert and data parallel, pipelines, FSDP2) through the
    public `torch.distributed` API: each returns at once with the documented values. A PyTorch release that calls
    a method the group does not implement fails here (NotImplementedError / a C++ error), not in a user's run."""
    assert (dist.get_rank(), dist.get_world_size()) == (1, 4)
    assert isinstance(dist.group.WORLD, StandInGroup) and dist.group.WORLD.group_name
    pair = dist.new_group([0, 1])
    dist.new_group([2, 3])  # every rank creates every group; not a member of this one
    assert dist.get_rank(pair) == 1 and dist.get_world_size(pair) == 2 and pair.group_name

    t = torch.arange(4.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pair)
    assert t.tolist() == [0, 1, 2, 3]  # this rank's value stands for the result
    works = [dist.all_reduce(torch.ones(2), async_op=True)]
    dist.broadcast(t, group_src=0, group=pair)
    dist.barrier()

    parts = [torch.empty(3) for _ in range(2)]
    dist.all_gather(parts, torch.tensor([1.0, 2.0, 3.0]), group=pair)
    assert all(p.tolist() == [1, 2, 3] for p in parts)
    out = torch.zeros(4, 3)
    out[1] = torch.tensor([4.0, 5.0, 6.0])
    works.append(dist.all_gather_into_tensor(out, out[1], async_op=True))  # in place, as FSDP2 gathers
    assert (out == torch.tensor([4.0, 5.0, 6.0])).all()

    shard = torch.empty(2)
    works.append(dist.reduce_scatter_tensor(shard, torch.arange(8.0), async_op=True))
    assert shard.tolist() == [2, 3]  # this rank's slice of its own input

    sent = torch.arange(6.0)
    received = torch.empty(6)
    dist.all_to_all_single(received, sent, [3, 3], [3, 3], group=pair)
    assert received.tolist() == sent.tolist()
    fewer = torch.full((4,), 7.0)
    dist.all_to_all_single(fewer, sent, [2, 2], [3, 3], group=pair)
    assert fewer.tolist() == [0, 1, 2, 3]

    dist.send(torch.ones(3), group_dst=0, group=pair)
    got = torch.full((3,), float("nan"))
    dist.recv(got, group_src=0, group=pair)
    assert got.tolist() == [0, 0, 0]
    buffer = torch.full((2,), float("nan"))
    ops = [dist.P2POp(dist.isend, torch.ones(2), 2), dist.P2POp(dist.irecv, buffer, 0)]
    works += dist.batch_isend_irecv(ops)
    assert buffer.tolist() == [0, 0]
    for w in works:
        assert w.wait() and w.is_completed()


def test_standin_group_runs_fully_shard_on_device_meshes(standin_world):
    """FSDP2 over a 1D mesh and HSDP's 2D mesh built from stand-in groups: shards of the right size, gradients."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dense = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    replicate, shard = dist.new_group([1, 3]), dist.new_group([0, 1])
    dist.new_group([0, 2])
    dist.new_group([2, 3])
    hsdp = DeviceMesh.from_group([replicate, shard], "cpu", mesh=torch.tensor([[0, 1], [2, 3]]),
                                 mesh_dim_names=("replicate", "shard"))
    for mesh, parts in ((dense, 4), (hsdp, 2)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert model[0].weight.to_local().shape == (8 // parts, 8)
        model(torch.randn(2, 8)).sum().backward()
        grad = model[0].weight.grad.to_local()
        assert grad.shape == (8 // parts, 8) and torch.isfinite(grad).all()


def test_standin_group_answers_the_older_method_names_as_the_newer_ones():
    """PyTorch 2.11's `distributed_c10d` calls the group's older names; each must do what the 2.13 name does (this
    machine runs 2.13, so these are called directly here)."""
    group = StandInGroup(1, 4)
    inp = torch.tensor([1.0, 2.0])
    new, old = torch.zeros(8), torch.zeros(8)
    group.all_gather_single(new, inp)
    group._allgather_base(old, inp)
    assert torch.equal(new, old) and new.tolist() == [1, 2] * 4
    news, olds = [torch.zeros(8)], [torch.zeros(8)]
    group.all_gather_single_coalesced(news, [inp])
    group.allgather_into_tensor_coalesced(olds, [inp])
    assert torch.equal(news[0], olds[0])
    new, old = torch.zeros(2), torch.zeros(2)
    group.reduce_scatter_single(new, torch.arange(8.0))
    group._reduce_scatter_base(old, torch.arange(8.0))
    assert torch.equal(new, old) and new.tolist() == [2, 3]
    news, olds = [torch.zeros(2)], [torch.zeros(2)]
    group.reduce_scatter_single_coalesced(news, [torch.arange(8.0)])
    group.reduce_scatter_tensor_coalesced(olds, [torch.arange(8.0)])
    assert torch.equal(news[0], olds[0])
    new, old = torch.zeros(8), torch.zeros(8)
    group.all_to_all_single(new, torch.arange(8.0), [2] * 4, [2] * 4)
    group.alltoall_base(old, torch.arange(8.0), [2] * 4, [2] * 4)
    assert torch.equal(new, old) and new.tolist() == list(range(8))


def test_standin_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="outside the world of 4 ranks"):
        init_standin(4, 4)


# --- balanced routing, the command line -------------------------------------------------------------------


def test_moe_routing_is_balanced_only_under_only_rank():
    from fivefold.models.llama import MoE, balanced_experts, build_model, force_balanced_routing

    counts = torch.bincount(balanced_experts(24, 2, 8, torch.device("cpu")).reshape(-1), minlength=8)
    assert counts.tolist() == [6] * 8
    choices = balanced_experts(24, 2, 8, torch.device("cpu"))
    assert (choices[:, 0] != choices[:, 1]).all()  # a token's experts are distinct
    model = build_model(build_config(None, MOE).model, seed=0)
    assert not any(m.balanced_routing for m in model.modules() if isinstance(m, MoE))  # a normal run: the router's
    assert force_balanced_routing(model) == sum(isinstance(m, MoE) for m in model.modules()) > 0
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    experts, weights = moe.route(torch.randn(16, moe.router.in_features))
    assert torch.bincount(experts.reshape(-1), minlength=moe.n_experts).unique().numel() == 1
    assert weights.requires_grad  # the router still weighs the chosen experts (and gets gradients)


def test_cli_only_rank_prints_measured_beside_predicted(capsys, tmp_path):
    args = ["train", "--preset", "tiny", "--layout.tp", "2", "--layout.pp", "2", "--max-steps", "2",
            "--only-rank", "3", *[f"--{k}={v}" for k, v in BASE.items()]]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "only rank 3 of 4 (pp 1, dp 0, cp 0, tp 1, ep 0)" in out and "step 2:" in out
    assert "prediction is for the last pipeline rank" in out
    for part in ("parameters", "gradients", "optimizer", "activations and buffers", "peak", "compute time"):
        assert f"  {part} (" in out
    # against a profile of this machine (`--hardware`, as `fivefold calibrate --out` writes one): its compute time
    slow = tmp_path / "slow-cpu.toml"
    # its matmuls 4x slower than the built-in profile's
    slow.write_text(f'name = "slow-cpu"\nbase = "cpu"\nfp32_tflops = {HARDWARE["cpu"].fp32_tflops / 4}\n')
    assert main([*args, "--json", "--hardware", str(slow)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rank"] == 3 and len(report["steps"]) == 2
    cfg = build_config(None, {**BASE, **DENSE, "layout.tp": "2", "layout.pp": "2"})
    predicted = planner_for_rank(cfg, 3, "cpu", str(slow))
    assert report["planner"]["hardware"] == "slow-cpu"
    assert report["compute_s"]["predicted"] == pytest.approx(predicted["compute_s"], rel=1e-9)
    assert predicted["compute_s"] > 2 * planner_for_rank(cfg, 3, "cpu")["compute_s"]
    want = closed_form(cfg, 3)
    for part in ("parameters", "gradients", "optimizer"):
        row = report["memory_bytes"][part]
        assert row["measured"] == row["predicted"] == want[part]


@pytest.mark.parametrize("extra, message", [
    (["--only-rank", "4"], "--only-rank 4: the layout dp 1 x tp 2 x pp 2 x cp 1 has 4 ranks; give a rank 0 .. 3"),
    (["--only-rank", "0", "--nproc", "2"], "does not take --nproc"),
    (["--only-rank", "0", "--resume", "--run-dir", "x"], "does not take --resume"),
    (["--json"], "--json goes with --only-rank"),
])
def test_cli_only_rank_refuses_by_name(extra, message, capsys):
    args = ["train", "--preset", "tiny", "--layout.tp", "2", "--layout.pp", "2", *extra,
            *[f"--{k}={v}" for k, v in BASE.items()]]
    assert main(args) != 0
    assert message in capsys.readouterr().err


# --- the examples/ configs ---------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# the layouts as configured (bf16 lean mixed precision included); shrunk so that a CPU runs two steps: 2 blocks (4 for
# the 70B's 4 pipeline stages), one micro-batch per rank and stage pass (the global batch = dp x micro-batch, x 4 for
# the 70B's pipeline), sequences of 64 tokens, no torch.compile, and width 256 / ffn 512 / vocabulary 1024
EXAMPLES = {"llama3.1-8b-1x8-h100": ("2", "8"), "olmoe-1b-7b-2x8-h100": ("2", "64"),
            "llama3.1-70b-4x8-h100": ("4", "4")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n.startswith("llama3.1-70b") else pytest.mark.slow)
                                  for n in EXAMPLES])
def test_rank_0_of_each_example_runs_two_steps_on_the_cpu(name, capsys):
    layers, batch = EXAMPLES[name]
    args = ["train", "--config", str(ROOT / "examples" / f"{name}.toml"), "--only-rank", "0", "--json",
            "--max-steps", "2", "--model.n_layers", layers, "--train.global_batch_size", batch,
            "--train.seq_len", "64", "--train.compile", "false", "--model.hidden", "256", "--model.ffn", "512",
            "--model.vocab_size", "1024", "--train.threads", "1", "--train.device", "cpu"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == 2 and all(s["seconds"] > 0 for s in report["steps"])
    assert any("random token ids" in note for note in report["notes"])  # the example's data.path is a placeholder
    for part in ("parameters", "gradients", "optimizer"):  # the layout's closed form, under bf16 mixed precision
        row = report["memory_bytes"][part]
        assert row["measured"] == row["predicted"] > 0, part


# --- fivefold plan --measure ---------------------------------------------------------------------------------


def test_ranks_to_measure_are_the_first_and_last_pipeline_stage_and_an_expert_rank():
    from fivefold.tools.only_rank import ranks_to_measure

    assert list(ranks_to_measure(config("tp2-pp2"))) == [0, 2]  # pp rank 1 starts at rank 2 (tp innermost)
    assert list(ranks_to_measure(config("pp2-dp2-ep2-zero3-moe"))) == [0, 2]
    assert "ep rank 0 of 2" in ranks_to_measure(config("ep2-dp2"))[0]
    assert list(ranks_to_measure(config("dp4-zero3"))) == [0]


def test_plan_measure_runs_the_layout_alone_and_prints_measured_beside_predicted(capsys):
    args = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "32", "--global-batch",
            "128", "--layout", "dp=2,micro_batch_size=2", "--measure", "--measure-steps", "1", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    (rank,) = report["measured"]
    assert rank["rank"] == 0 and len(rank["steps"]) == 1
    for part in ("parameters", "gradients", "optimizer"):
        assert rank["memory_bytes"][part]["measured"] == rank["memory_bytes"][part]["predicted"] > 0


@pytest.mark.slow
def test_plan_measure_prints_a_table_of_the_first_and_last_stage():
    from io import StringIO

    from fivefold.tools.only_rank import measure_ranks, print_measured

    out = StringIO()
    reports = measure_ranks(config("tp2-pp2"), 1, out)
    print_measured(reports, out)
    text = out.getvalue()
    assert "measuring rank 0 (first pipeline stage) alone: 1 steps" in text
    assert "measuring rank 2 (last pipeline stage) alone: 1 steps" in text
    assert [r["rank"] for r in reports] == [0, 2] and "peak MiB" in text
    cfg = config("tp2-pp2")
    for r in reports:
        want = closed_form(cfg, r["rank"])
        assert {k: r["memory_bytes"][k]["measured"] for k in want} == want
