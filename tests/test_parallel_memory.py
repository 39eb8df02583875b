"""Bytes of parameters, gradients and optimizer states that each rank holds, against the closed form of the
playbook's ZeRO table for fp32 master weights (4 bytes per parameter, 4 per gradient, 8 for Adam's two
moments; the table's k = 12 of mixed precision counts the fp32 master copy in the optimizer, which here is the
parameter itself):

    stage 0: 4Ψ + 4Ψ + 8Ψ      stage 1: 4Ψ + 4Ψ + 8Ψ/N_d
    stage 2: 4Ψ + (4 + 8)Ψ/N_d stage 3: (4 + 4 + 8)Ψ/N_d

where Ψ is the parameter count of one tp rank: the projections, MLP and (tied) embedding divided by tp, the
norms replicated. Ψ is counted here from the model's shape, independently of the code under test. Gradients
are measured after a backward (ZeRO-3 keeps them only until the step), optimizer states after a first step.
The model's dims are multiples of 12, so tp 1 to 4 divide it and no shard needs padding.
"""

from __future__ import annotations

import pytest
import torch
from tests.distributed import run_ranks

from fivefold.config import ModelConfig, build_config

MODEL = {"model.n_layers": "2", "model.hidden": "96", "model.n_heads": "12", "model.n_kv_heads": "12",
         "model.ffn": "192", "model.vocab_size": "384"}


def params_per_tp_rank(m: ModelConfig, tp: int) -> int:
    h, d = m.hidden, m.head_dim
    attention = h * m.n_heads * d * 2 + h * m.n_kv_heads * d * 2  # q, o and k, v
    mlp = 3 * h * m.ffn
    embeddings = m.vocab_size * h * (1 if m.tied_embeddings else 2)
    replicated = m.n_layers * 2 * h + h  # two norms per block and the final norm
    return (embeddings + m.n_layers * (attention + mlp)) // tp + replicated


def closed_form(zero: int, psi: int, dp: int) -> dict[str, int]:
    params, grads, optimizer = 4 * psi, 4 * psi, 8 * psi
    return {
        "parameters": params // dp if zero >= 3 else params,
        "gradients": grads // dp if zero >= 2 else grads,
        "optimizer": optimizer // dp if zero >= 1 else optimizer,
    }


def held_bytes_on_ranks(rank: int, world_size: int, tp: int, stages: list[int],
                        extra: dict[str, str] | None = None) -> list[dict[str, int]]:
    from fivefold.train.build import build_engine

    out = []
    for zero in stages:
        cfg = build_config(None, {**MODEL, "layout.dp": str(world_size // tp), "layout.tp": str(tp),
                                  "layout.zero": str(zero), "train.seq_len": "8", "train.global_batch_size": "4",
                                  "train.device": "cpu", "train.dtype": "fp32", **(extra or {})})
        engine = build_engine(cfg, torch.device("cpu"))
        tokens = torch.randint(0, 384, (4 // cfg.layout.dp, 9), generator=torch.Generator().manual_seed(0))
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        engine.forward_backward(batch, 32)
        engine.optimizer_step()
        engine.forward_backward(batch, 32)
        out.append(engine.state_bytes())
    return out


def check(tp: int, dp: int, stages: list[int], dp_shard: int = 0) -> None:
    """Every rank's bytes against the closed form; under HSDP (`dp_shard`) the states shard over dp_shard."""
    m = build_config(None, MODEL).model
    psi = params_per_tp_rank(m, tp)
    extra = {"layout.dp_shard": str(dp_shard)} if dp_shard else None
    for rank, held in enumerate(run_ranks(dp * tp, held_bytes_on_ranks, tp, stages, extra)):
        for zero, got in zip(stages, held, strict=True):
            assert got == closed_form(zero, psi, dp_shard or dp), f"rank {rank}, zero {zero}, tp {tp}, dp {dp}"


def test_zero_stages_hold_the_closed_form_bytes():
    check(tp=1, dp=2, stages=[0, 1, 2, 3])


def test_hsdp_holds_the_closed_form_bytes_of_its_shard_group():
    check(tp=1, dp=4, stages=[3], dp_shard=2)


def test_tensor_parallel_holds_the_closed_form_bytes():
    check(tp=2, dp=1, stages=[0])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_zero_stages_under_tensor_parallel_hold_the_closed_form_bytes(tp):
    check(tp=tp, dp=2, stages=[0, 1, 2, 3])


# --- lean mixed precision: bf16 working weights, fp32 master slices (the distributed optimizer) ---------------


def lean_bytes_on_ranks(rank: int, world_size: int, fp32_grads: bool) -> dict[str, int]:
    from fivefold.train.build import build_engine

    cfg = build_config(None, {**MODEL, "layout.dp": str(world_size), "layout.zero": "1",
                              "layout.fp32_grad_accum": str(fp32_grads).lower(), "train.seq_len": "8",
                              "train.global_batch_size": "4", "train.device": "cpu", "train.dtype": "bf16"})
    engine = build_engine(cfg, torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    tokens = torch.randint(0, 384, (4 // world_size, 9), generator=torch.Generator().manual_seed(0))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    engine.forward_backward(batch, 32)
    engine.optimizer_step()
    engine.forward_backward(batch, 32)
    return engine.state_bytes()


def check_lean(dp: int, fp32_grads: bool) -> None:
    """Per parameter per rank: 2 (bf16 weights) + 2 or 4 (bf16 or fp32 gradients) + 12 / dp (fp32 master and
    Adam's two moments, sharded by ZeRO-1): the playbook's ZeRO-1 row, Megatron's distributed optimizer."""
    from fivefold.planner.layout import FIVEFOLD_LEAN, Layout
    from fivefold.planner.memory import model_state_bytes

    model = build_config(None, MODEL).model
    psi = params_per_tp_rank(model, 1)
    assert psi % dp == 0  # no padding, so the bytes are exact
    predicted = model_state_bytes(model, Layout(dp=dp, zero=1, fp32_grad_accum=fp32_grads), FIVEFOLD_LEAN, seq=128)
    for held in run_ranks(dp, lean_bytes_on_ranks, fp32_grads):
        assert held == {"parameters": 2 * psi, "gradients": (4 if fp32_grads else 2) * psi,
                        "optimizer": 12 * psi // dp}
        assert sum(held.values()) == (2 + (4 if fp32_grads else 2)) * psi + 12 * psi // dp
        assert sum(predicted.values()) == sum(held.values())  # the planner's state bytes follow the engine


def test_lean_mixed_precision_zero1_bytes_per_parameter():
    check_lean(dp=2, fp32_grads=False)


@pytest.mark.slow
@pytest.mark.parametrize("fp32_grads", [False, True])
def test_lean_mixed_precision_zero1_dp4_bytes_per_parameter(fp32_grads):
    check_lean(dp=4, fp32_grads=fp32_grads)


def default_gradient_dtypes(rank: int, world_size: int, zero: int, pp: int = 1) -> tuple[set, set, dict[str, int]]:
    """Under bf16 working weights with `layout.fp32_grad_accum` left at its default, after two micro-batches: the
    dtypes the gradient buckets accumulate and reduce in, those of what AdamW steps on, and the state bytes."""
    from fivefold.train.build import build_engine

    cfg = build_config(None, {**MODEL, "layout.dp": str(world_size // pp), "layout.pp": str(pp),
                              "layout.zero": str(zero), "layout.micro_batch_size": "1", "train.seq_len": "8",
                              "train.global_batch_size": "4",
                              "train.device": "cpu", "train.dtype": "bf16"})
    engine = build_engine(cfg, torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters()) or zero == 3
    tokens = torch.randint(0, 384, (4 * pp // world_size, 9), generator=torch.Generator().manual_seed(rank))
    engine.forward_backward([(tokens[i:i + 1, :-1], tokens[i:i + 1, 1:]) for i in range(2)], 32)
    dp = engine.data_parallel
    if zero == 3:
        reduced = {p.grad.dtype for p in dp.optimizer_params() if p.grad is not None}
        return reduced, {p.dtype for p in dp.optimizer_params()}, engine.state_bytes()
    accumulated = {b.grad_dtype for b in dp.buckets}
    reduced = {dp.reduced_grad(b).dtype for b in dp.buckets}
    return accumulated | reduced, {p.dtype for p in dp.optimizer_params()}, engine.state_bytes()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_default_gradients_accumulate_and_reduce_in_fp32(zero):
    """The default (`layout.fp32_grad_accum = true`) on every data-parallel path under bf16 working weights: the
    buckets accumulate and reduce fp32 gradients (ZeRO-0/1/2: 4 bytes per parameter, /dp under ZeRO-2), ZeRO-3's
    fully_shard reduce-scatters into fp32 gradient shards; AdamW steps fp32 masters."""
    model = build_config(None, MODEL).model
    psi = params_per_tp_rank(model, 1)
    for grads, stepped, held in run_ranks(2, default_gradient_dtypes, zero):
        assert grads == {torch.float32} and stepped == {torch.float32}
        assert held["gradients"] == {0: 4 * psi, 1: 4 * psi, 2: 4 * psi // 2, 3: 4 * psi // 2}[zero]


def test_default_gradients_are_fp32_under_a_pipeline():
    """The same default on a pipeline's stages (pp2, 1F1B over two micro-batches): fp32 buckets on both ranks."""
    for grads, stepped, _ in run_ranks(2, default_gradient_dtypes, 0, 2):
        assert grads == {torch.float32} and stepped == {torch.float32}


def zero2_full_buckets(rank: int, world_size: int, pp: int, schedule: str) -> tuple[int, int, int]:
    """ZeRO-2 over dp2 (of a pp-stage pipeline), four micro-batches, small buckets: (the most full gradient buckets
    alive at any gradient arrival, counted by hooks of the test's own after the engine's, the rank's buckets, the
    gradient slice's bytes after the step's backward)."""
    from fivefold.train.build import build_engine

    cfg = build_config(None, {**MODEL, "layout.dp": str(world_size // pp), "layout.pp": str(pp),
                              "layout.schedule": schedule, "layout.zero": "2", "layout.dp_bucket_size": "3000",
                              "layout.micro_batch_size": "1", "train.seq_len": "8", "train.global_batch_size": "8",
                              "train.device": "cpu", "train.dtype": "fp32"})
    engine = build_engine(cfg, torch.device("cpu"))
    dp = engine.data_parallel
    most = [0]

    def count(_p: torch.Tensor) -> None:
        most[0] = max(most[0], sum(b.grad is not None for b in dp.buckets))

    for bucket in dp.buckets:
        for p in bucket.params:
            p.register_post_accumulate_grad_hook(count)
    tokens = torch.randint(0, 384, (4, 9), generator=torch.Generator().manual_seed(rank))
    engine.forward_backward([(tokens[i:i + 1, :-1], tokens[i:i + 1, 1:]) for i in range(4)], 64)
    return most[0], len(dp.buckets), engine.state_bytes()["gradients"]


@pytest.mark.parametrize("pp,schedule", [(1, "1f1b"), (2, "1f1b"), (2, "zero-bubble")])
def test_zero2_holds_at_most_three_full_gradient_buckets(pp, schedule):
    """ZeRO-2 frees a full bucket once its reduce-scatter is done, at most `ZERO2_IN_FLIGHT` (2) in flight beside
    the one filling, also in a pipeline, whose micro-batches end only with the step (before, every bucket lived
    until then: the 70B example's first stage held its whole fp32 gradient beside its slice)."""
    from fivefold.parallel.data import ZERO2_IN_FLIGHT

    for most, buckets, _ in run_ranks(2 * pp, zero2_full_buckets, pp, schedule):
        assert buckets >= 2 * (ZERO2_IN_FLIGHT + 1), "too few buckets for the bound to show"
        assert most <= ZERO2_IN_FLIGHT + 1, (most, buckets)
