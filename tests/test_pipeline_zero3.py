"""ZeRO-3 composed with pipeline parallel (`parallel.pipeline_zero3`), dp2 x pp2 on 4 gloo ranks, against one
process: the method and tolerances of tests/test_parallel_equivalence.py (K = 3 steps of a tiny Llama in fp32;
losses and the evaluation loss to 1e-5 relative, gradient norms to 1e-4, parameters to 5e-4 relative by norm),
with the pipeline checks of tests/test_parallel_pipeline.py (each rank ran exactly its action list, no deferred
weight gradient left). On top, closed forms on every rank: each `fully_shard` unit all-gathers once per optimizer
step and reduce-scatters once per step (not once per micro-batch), and the rank holds exactly its stages'
parameters, gradients and AdamW moments divided by dp (under ep: dense / dp + its ep rank's experts / edp).

Fast (default run): 1F1B, AFAB and zero-bubble (whose W passes must all run before the reduce-scatter) with the
counts and bytes; dp2 x pp2 x ep2 on the MoE model (edp 1: the experts cut as plain ZeRO-3 cuts them); checkpoints
from and to one process. Slow: interleaved (two stages per rank), DualPipeV (the tied embedding's two copies on
one rank), the MoE model, cp2 x pp2 with full recompute, untied with selective recompute, dp2 x tp2+SP x pp2 (8
ranks), bf16; with expert parallel dp4 x pp2 x ep2 (8 ranks, edp 2, also in bf16), the other schedules, cp2 x pp2
x ep2 and checkpoints to one process and back (edp 1 and 2).
"""

from __future__ import annotations

import pytest
import torch
from tests.distributed import run_ranks
from tests.test_checkpoint_reshard import check_change
from tests.test_parallel_equivalence import (
    STEPS,
    assert_matches_one_process,
    global_batches,
    reference_run,
    tiny_config,
    train_steps,
)
from tests.test_train import dataset  # noqa: F401  (a fixture)

Z3PP = {"layout.pp": "2", "layout.dp": "2", "layout.zero": "3", "layout.micro_batch_size": "1"}  # 4 micro-batches


def counted(name: str, counts: dict[str, int]):
    """`torch.distributed.<name>` (what fully_shard calls for its all-gathers and reduce-scatters) with a counter."""
    import torch.distributed as dist

    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    setattr(dist, name, wrapper)
    return original


def zero3_pipeline_on_ranks(rank: int, world_size: int, layouts: list[dict[str, str]]) -> list:
    """Train each layout; check the collective counts and the state bytes against their closed forms; rank 0
    returns (losses, norms, drops, state) of each."""
    import torch.distributed as dist

    from fivefold.parallel.pipeline_zero3 import PipelineFullyShardedDataParallel
    from fivefold.train.build import build_engine

    results = []
    for overrides in layouts:
        cfg = tiny_config(overrides)
        engine = build_engine(cfg, torch.device("cpu"))
        assert isinstance(engine.data_parallel, PipelineFullyShardedDataParallel)
        counts = {"all_gather_single": 0, "reduce_scatter_single": 0}
        originals = {name: counted(name, counts) for name in counts}
        try:
            losses, norms, drops = train_steps(engine, cfg)  # STEPS steps, then one evaluation forward
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        units = engine.data_parallel.n_units()
        blocks = sum(len(stage.layers) for stage in engine.runner.stages.values())
        # one unit per block and one per stage root; under ep per MoE block also the router, the shared experts
        # and (edp > 1) the routed experts
        ep, dpc = cfg.layout.ep, cfg.layout.dp * cfg.layout.cp
        per_moe = (1 + (cfg.model.n_shared_experts > 0) + (dpc // ep > 1)) if ep > 1 and cfg.model.is_moe else 0
        assert units == blocks * (1 + per_moe) + len(engine.runner.stages)
        # a root communicates when it holds parameters of its own: the embedding, or the final norm and output
        # layer; with edp = 1 the routed experts are no unit's (plain tensors)
        talking = blocks * (1 + per_moe) + sum(1 for stage in engine.runner.stages.values()
                                               if stage.embed is not None or stage.norm is not None)
        assert talking == talking_units(engine.data_parallel)
        if cfg.layout.dp_shard * cfg.layout.cp == 1:  # HSDP with shard groups of one rank: nothing to gather
            talking = 0
        assert counts["all_gather_single"] == (STEPS + 1) * talking, (counts, talking)  # + the evaluation forward
        assert counts["reduce_scatter_single"] == STEPS * talking, (counts, talking)
        schedule = engine.runner.schedule(cfg.grad_accum_steps)
        assert [r.action for r in engine.runner.traces[True]] == list(schedule.actions[engine.pp_rank])
        if engine.runner.queue is not None:
            assert len(engine.runner.queue) == 0
        # closed form: the rank's stages' parameters (the plain modules, fp32), gradients and two moments, over dp;
        # a tied weight counts once per stage that holds it (two copies under ZeRO-3, see pipeline_zero3); under ep,
        # dense / (dp x cp) + this ep rank's experts (1/ep of the plain stages' experts) / edp
        from fivefold.parallel.expert import is_expert_param
        from fivefold.parallel.pipeline import build_stages

        plain = build_stages(cfg.model, engine.runner.counts, engine.runner.placement, engine.pp_rank,
                             torch.device("meta"), 0)
        named = [(n, p.numel()) for stage in plain.values() for n, p in stage.named_parameters()]
        experts = sum(k for n, k in named if is_expert_param(n)) if ep > 1 else 0
        dense = sum(k for _, k in named) - experts
        state = engine.model_state()
        inputs, targets = global_batches(cfg)[0]  # one more backward, so that the gradient shards exist
        rows = inputs.shape[0] // engine.dp_size
        lo = engine.dp_rank * rows
        micro = list(zip(inputs[lo:lo + rows].split(cfg.micro_batch_size),
                         targets[lo:lo + rows].split(cfg.micro_batch_size), strict=True))
        engine.forward_backward(micro, inputs.numel())
        held = engine.state_bytes()
        edp = dpc // ep
        shards = (cfg.layout.dp_shard or cfg.layout.dp) * cfg.layout.cp  # HSDP: the shard group, else dp x cp
        assert dense % shards == 0 and experts % (ep * edp) == 0
        numel = dense // shards + experts // ep // edp
        assert held == {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer": 8 * numel}, (held, numel)
        results.append((losses, norms, drops, state if rank == 0 else None, held))
    return results


def talking_units(data_parallel) -> int:
    """The `fully_shard` units that hold sharded parameters of their own (not an inner unit's, not ignored)."""
    count = 0
    for units in data_parallel.units.values():
        for unit in units:
            inner = {id(p) for other in units if other is not unit and any(m is other for m in unit.modules())
                     for p in other.parameters()}
            count += any(id(p) not in inner and hasattr(p, "device_mesh") for p in unit.parameters())
    return count


def assert_zero3_pipeline_equivalent(layouts: list[dict[str, str]], world_size: int = 4) -> list:
    """Each layout against one process; the ranks' results (losses, norms, drops, state on rank 0, held bytes)."""
    results = run_ranks(world_size, zero3_pipeline_on_ranks, layouts, timeout=300.0 * world_size / 4)
    for overrides, (losses, norms, drops, state, _) in zip(layouts, results[0], strict=True):
        assert_matches_one_process(overrides, losses, norms, drops, state)
    return results


def test_zero3_pipeline_1f1b_afab_and_zero_bubble_match_one_process():
    assert_zero3_pipeline_equivalent([{**Z3PP, "layout.schedule": s} for s in ("1f1b", "afab", "zero-bubble")])


def test_hsdp_pipeline_matches_one_process():
    """HSDP under pp2: each stage's units over the replicate x shard mesh (dp2 with shard groups of 1: the two
    dp ranks replicate every stage; the tied embedding's copies on the first and last pipeline rank)."""
    assert_zero3_pipeline_equivalent([{**Z3PP, "layout.dp_shard": "1"}])


@pytest.mark.slow
def test_zero3_pipeline_interleaved_dualpipev_and_moe_match_one_process():
    assert_zero3_pipeline_equivalent([
        {**Z3PP, "layout.schedule": "interleaved", "layout.vpp": "2", "model.n_layers": "4"},
        {**Z3PP, "layout.schedule": "dualpipev", "model.n_layers": "4"},
        {**Z3PP, "layout.schedule": "1f1b", "model.n_experts": "4", "model.top_k": "2"},
    ])


Z3PPEP = {**Z3PP, "layout.ep": "2", "layout.schedule": "1f1b", "model.n_experts": "4", "model.top_k": "2"}


def test_zero3_pipeline_with_expert_parallel_edp1_matches_one_process():
    """dp2 x pp2 x ep2 (edp 1: each rank's experts whole, plain tensors no unit holds) against one process, with
    the unit counts, the collective counts and the bytes per rank (dense / dp + experts / ep) of the tests above."""
    results = assert_zero3_pipeline_equivalent([Z3PPEP])
    held = [r[0][4] for r in results]
    assert len({h["parameters"] for h in held}) == 2, held  # the two pp ranks hold different stages


@pytest.mark.slow
def test_zero3_pipeline_with_expert_parallel_edp2_matches_one_process():
    """dp4 x pp2 x ep2 on 8 ranks: the routed experts are fully_shard units over edp groups of two ranks."""
    assert_zero3_pipeline_equivalent([{**Z3PPEP, "layout.dp": "4"}], 8)


@pytest.mark.slow
def test_zero3_pipeline_with_expert_parallel_under_every_other_schedule_matches_one_process():
    """dp2 x pp2 x ep2 under zero-bubble (the experts' W work before the reduce-scatter), DualPipeV (both tied
    copies on one rank) and interleaved (two stages per rank)."""
    assert_zero3_pipeline_equivalent([{**Z3PPEP, "layout.schedule": "zero-bubble"},
                                      {**Z3PPEP, "layout.schedule": "dualpipev", "model.n_layers": "4"},
                                      {**Z3PPEP, "layout.schedule": "interleaved", "layout.vpp": "2",
                                       "model.n_layers": "4"}])


def assert_bf16_matches_one_process(overrides: dict[str, str], world: int, params: float) -> None:
    """The bf16 checks of the tests below against the one-process bf16 engine: the first loss to 1e-4, later
    losses to 5e-3, gradient norms to 3 %, each parameter to `params` relative by norm."""
    losses, norms, _, state, _ = run_ranks(world, zero3_pipeline_on_ranks, [overrides], timeout=600.0)[0][0]
    ref_losses, ref_norms, _, ref_state = reference_run(overrides)
    assert abs(losses[0] - ref_losses[0]) <= 1e-4 * abs(ref_losses[0])
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 5e-3 * abs(b), (a, b)
    for a, b in zip(norms, ref_norms, strict=True):
        assert abs(a - b) <= 3e-2 * abs(b), (a, b)
    for name, ref in ref_state.items():
        assert ((state[name] - ref).norm() / ref.norm()).item() <= params, name


@pytest.mark.slow
def test_zero3_pipeline_with_expert_parallel_bf16_matches_one_process_bf16():
    """dp4 x pp2 x ep2 (edp 2: the experts' units gather in bf16 and reduce-scatter in fp32 too) against the
    one-process bf16 engine, with the tolerances of the bf16 test above but for the parameters: under bf16 the MoE
    model's router and experts move 0.32 (router) and 0.21 (experts) apart by norm after 3 steps whatever the
    layout (ZeRO-1 x pp2 x ep2 0.317, ZeRO-3 x pp2 without ep 0.322, ZeRO-3 x ep2 without pp 0.319, ZeRO-1 x ep2
    0.317: a routing decision that bf16 rounding flips), so 0.4 there."""
    assert_bf16_matches_one_process({**Z3PPEP, "layout.dp": "4", "train.dtype": "bf16"}, 8, params=0.4)


@pytest.mark.slow
def test_zero3_pipeline_with_expert_parallel_over_cp_matches_one_process():
    """cp2 x pp2 x ep2: ep folds over the cp ranks (edp 1), ZeRO-3 shards the dense weights over dp x cp."""
    from tests.test_parallel_pipeline import assert_pipeline_equivalent

    assert_pipeline_equivalent([{"layout.pp": "2", "layout.cp": "2", "layout.ep": "2", "layout.zero": "3",
                                 "layout.micro_batch_size": "2", "model.n_experts": "4", "model.top_k": "2"}], 4)


@pytest.mark.slow
def test_zero3_pipeline_composes_with_cp_tp_sp_and_recompute():
    """cp2 x pp2 (ZeRO-3 over dp x cp) zero-bubble with full recompute; dp2 x pp2 untied with selective recompute;
    dp2 x tp2+SP x pp2 zero-bubble (8 ranks): against one process, with the pipeline test's checks."""
    from tests.test_parallel_pipeline import assert_pipeline_equivalent

    assert_pipeline_equivalent([
        {"layout.pp": "2", "layout.cp": "2", "layout.zero": "3", "layout.schedule": "zero-bubble",
         "layout.micro_batch_size": "2", "layout.recompute": "full"},
        {**Z3PP, "model.tied_embeddings": "false", "layout.recompute": "selective"},
    ], 4)
    assert_pipeline_equivalent([{**Z3PP, "layout.tp": "2", "layout.sp": "true", "layout.schedule": "zero-bubble"}], 8)


@pytest.mark.slow
def test_zero3_pipeline_bf16_matches_one_process_bf16():
    """bf16 all-gathers and fp32 reduce-scatters (the policy of plain ZeRO-3) against the one-process engine under
    CPU bf16 autocast, with the tolerances of test_parallel_equivalence's lean bf16 test and their reasons: the
    first loss to 1e-4 (both start from the same bf16-rounded weights; only the residual stream's dtype
    differs), later losses to 5e-3 and gradient norms to 3 % (bf16 rounding, unit roundoff 2^-9, compounded over
    the steps), parameters to 0.15 by norm (AdamW's near sign-like update flips with nearly cancelling
    gradient elements). A missing or doubled reduction moves the losses by far more."""
    assert_bf16_matches_one_process({**Z3PP, "layout.schedule": "1f1b", "train.dtype": "bf16"}, 4, params=0.15)


def test_zero3_pipeline_checkpoint_to_and_from_one_process(tmp_path, dataset):  # noqa: F811
    """A dp2 x pp2 ZeRO-3 checkpoint resumes on one process, and a one-process checkpoint under dp2 x pp2 ZeRO-3;
    the losses after the cut equal the uninterrupted run's within 1e-5 relative."""
    layout = {"layout.pp": "2", "layout.dp": "2", "layout.zero": "3", "layout.micro_batch_size": "1"}
    check_change(tmp_path / "a", dataset, (4, layout), [(1, {"layout.micro_batch_size": "1"})])
    check_change(tmp_path / "b", dataset, (1, {"layout.micro_batch_size": "1"}), [(4, layout)])


@pytest.mark.slow
def test_zero3_pipeline_expert_checkpoint_to_and_from_one_process(tmp_path, dataset):  # noqa: F811
    """dp2 x pp2 x ep2 ZeRO-3 (edp 1) to one process and back, as above."""
    layout = {"layout.pp": "2", "layout.dp": "2", "layout.ep": "2", "layout.zero": "3", "layout.micro_batch_size": "1"}
    moe = {"model.n_experts": "4", "model.top_k": "2"}
    check_change(tmp_path / "a", dataset, (4, layout), [(1, {"layout.micro_batch_size": "1"})], model=moe)
    check_change(tmp_path / "b", dataset, (1, {"layout.micro_batch_size": "1"}), [(4, layout)], model=moe)


@pytest.mark.slow
def test_zero3_pipeline_expert_over_edp2_checkpoint_moves_between_layouts(tmp_path, dataset):  # noqa: F811
    """dp4 x pp2 x ep2 ZeRO-3 (edp 2, 8 ranks) to one process and to dp2 x pp2 x ep2 ZeRO-3 (edp 1)."""
    moe = {"model.n_experts": "4", "model.top_k": "2"}
    z3 = {"layout.pp": "2", "layout.ep": "2", "layout.zero": "3", "layout.micro_batch_size": "1"}
    check_change(tmp_path, dataset, (8, {**z3, "layout.dp": "4"}),
                 [(1, {"layout.micro_batch_size": "1"}), (4, {**z3, "layout.dp": "2"})], model=moe)
