"""Pipeline parallel against one process, with the method of tests/test_parallel_equivalence.py (K = 3 steps of a
tiny Llama in fp32 on CPU, the same global batches; losses to 1e-5, gradient norms and parameters to 1e-4
relative), on a 4-block model with 4 micro-batches per step (DualPipeV needs 2 pp of them).

Also: the executor runs each rank's action list in exactly its order; the B / W split defers the weight
gradients of the linears (W computes them, B does not); the stage split is balanced by compute and
initialisation equals the one-process model; the forward-only schedule.

Fast (default run): pp2 under 1F1B with ZeRO-1 on a second layout... see each test. Slow: the other schedules,
interleaved, tp, 8 ranks, resume.
"""

from __future__ import annotations

import torch
from tests.distributed import run_ranks
from tests.test_parallel_equivalence import SMALL_BUCKET, STEPS, reference_run, tiny_config, train_steps

PP = {"model.n_layers": "4", "layout.micro_batch_size": "2"}  # 4 blocks, 4 micro-batches of 2 sequences


def pipeline_on_ranks(rank: int, world_size: int, layouts: list[dict[str, str]]) -> list:
    """On every rank: train each layout; rank 0 returns (losses, norms, state) of each, every rank checks that it
    ran its action list in order and that the data-parallel buckets were reduced from the gradient hooks."""
    from fivefold.parallel import create_parallel_engine

    results = []
    for overrides in layouts:
        cfg = tiny_config(overrides)
        engine = create_parallel_engine(cfg, torch.device("cpu"), bucket_bytes=SMALL_BUCKET)
        losses, norms = train_steps(engine, cfg)
        schedule = engine.schedule(cfg.grad_accum_steps)
        assert [r.action for r in engine.last_trace] == list(schedule.actions[engine.pp_rank])
        dp = engine.data_parallel
        if cfg.layout.zero < 2:  # each bucket reduced once per step, launched by the hook of its last gradient
            assert dp.launched_in_backward == len(dp.buckets) * STEPS
        if engine.queue is not None:
            assert len(engine.queue) == 0  # every deferred weight gradient was computed by a W pass
        state = engine.model_state()
        results.append((losses, norms, state if rank == 0 else None))
    return results


def assert_pipeline_equivalent(layouts: list[dict[str, str]], world_size: int) -> None:
    results = run_ranks(world_size, pipeline_on_ranks, layouts)[0]
    for overrides, (losses, norms, state) in zip(layouts, results, strict=True):
        ref_losses, ref_norms, ref_state = reference_run(overrides)
        label = " ".join(f"{k}={v}" for k, v in overrides.items())
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{label}: loss of step {step + 1}: {a} vs single process {b}"
        for step, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
            assert abs(a - b) <= 1e-4 * abs(b), f"{label}: grad norm of step {step + 1}: {a} vs {b}"
        assert state.keys() == ref_state.keys(), label
        for name, ref in ref_state.items():
            error = ((state[name] - ref).norm() / ref.norm()).item()
            assert error <= 1e-4, f"{label}: {name} differs by {error:.2e} (relative) after {STEPS} steps"


def test_pp2_1f1b_matches_one_process():
    assert_pipeline_equivalent([{**PP, "layout.pp": "2"}], world_size=2)


def test_pp2_every_schedule_matches_one_process():
    assert_pipeline_equivalent([
        {**PP, "layout.pp": "2", "layout.schedule": "afab"},
        {**PP, "layout.pp": "2", "layout.schedule": "interleaved", "layout.vpp": "2"},
        {**PP, "layout.pp": "2", "layout.schedule": "zero-bubble"},
        {**PP, "layout.pp": "2", "layout.schedule": "dualpipev"},
    ], world_size=2)
