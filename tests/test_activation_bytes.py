"""Activation bytes per token per layer under bf16 against the lean count (docs/parallelism.md, "Activation memory
per token per layer"): every tensor that backward needs, saved once, in bf16 (the reciprocal RMS and the attention
log-sum-exp in fp32), sharded by tp under sequence parallelism.

The lean count, per token per layer of a Llama block with hidden h, ffn f, H query and K kv heads of dim d, on one
tp rank of t with sequence parallelism (everything divides by t):

    2 RMSNorms:  input 2h + 1/rms 4 + output 2h   (the output is the next matmuls' saved input, once for q, k, v)
    attention:   q (rotated) 2Hd, k (rotated) 2Kd, v 2Kd, output 2Hd (also o's input), log-sum-exp 4H
    SwiGLU:      gate 2f, up 2f, silu(gate) 2f, product 2f (down's input)

    lean = (8h + 8 + 4Hd + 4Kd + 4H + 8f) / t

Measured: the distinct storages a block's forward leaves for backward (`tests.test_recompute.held_bytes`: autograd's
saved tensors, deduplicated by storage, the block's input included since its first norm saves it, parameters and
the rotary tables excluded), at two sequence lengths, per token of the whole sequence, on bf16 working weights
under CPU bf16 autocast (the lean mixed precision of the engines)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.distributed import run_ranks
from tests.test_recompute import held_bytes

from fivefold.models.llama import Block, build_model, rope_cos_sin
from fivefold.presets import get_preset

ROWS, SEQS = 1, (8, 16)


def lean_bytes_per_token(cfg, tp: int) -> float:
    h, f, d, heads, kv = cfg.hidden, cfg.ffn, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    norms = 2 * (2 * h + 4 + 2 * h)
    attention = 2 * heads * d + 2 * (2 * kv * d) + 2 * heads * d + 4 * heads
    swiglu = 4 * 2 * f
    return (norms + attention + swiglu) / tp


def block_bytes(block: torch.nn.Module, cfg, seq: int, local_seq: int) -> int:
    x = torch.randn(ROWS, local_seq, cfg.hidden, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.float32 if cfg.fp32_residual else torch.bfloat16).requires_grad_()
    cos, sin = (t.to(torch.bfloat16) for t in rope_cos_sin(cfg, torch.arange(seq)))
    exclude = {t.untyped_storage().data_ptr() for t in [cos, sin, *block.parameters()]}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        held, _ = held_bytes(lambda: block(x, cos, sin), exclude)
    return held


def per_token(measure) -> float:
    a, b = (measure(seq) for seq in SEQS)
    return (b - a) / (ROWS * (SEQS[1] - SEQS[0]))


def config(preset: str):
    """One block of the preset's shape (a small vocabulary: the embedding is not part of a block)."""
    return dataclasses.replace(get_preset(preset), n_layers=1, vocab_size=256, tied_embeddings=False)


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b"])
def test_bf16_block_saves_the_lean_count(preset):
    cfg = config(preset)
    torch.manual_seed(0)
    block = Block(cfg).to(torch.bfloat16)
    measured = per_token(lambda seq: block_bytes(block, cfg, seq, seq))
    lean = lean_bytes_per_token(cfg, 1)
    assert abs(measured / lean - 1) <= 0.05, (measured, lean)


def tp_sp_bytes_on_ranks(rank: int, world_size: int, preset: str) -> float:
    import torch.distributed as dist

    from fivefold.parallel.tensor import apply_tensor_parallel

    cfg = config(preset)
    model = build_model(cfg, "cpu", seed=0)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=True)
    block = model.layers["0"].to(torch.bfloat16)
    return per_token(lambda seq: block_bytes(block, cfg, seq, seq // world_size))


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b"])
def test_bf16_block_under_tp2_and_sp_saves_the_lean_count(preset):
    cfg = config(preset)
    lean = lean_bytes_per_token(cfg, 2)
    for measured in run_ranks(2, tp_sp_bytes_on_ranks, preset):
        assert abs(measured / lean - 1) <= 0.05, (measured, lean)


def test_an_fp32_residual_stream_costs_its_two_extra_bytes():
    """`model.fp32_residual`: the norms' inputs (the stream) are fp32, everything else as before: the lean count
    plus 2 x 2h bytes per token per layer; the block's output stays fp32 and the planner counts the same."""
    from fivefold.planner.layout import FIVEFOLD, Layout
    from fivefold.planner.memory import layer_activation_bytes

    cfg = dataclasses.replace(config("llama-3.2-1b"), fp32_residual=True)
    torch.manual_seed(0)
    block = Block(cfg).to(torch.bfloat16)
    measured = per_token(lambda seq: block_bytes(block, cfg, seq, seq))
    assert measured == lean_bytes_per_token(cfg, 1) + 2 * 2 * cfg.hidden
    x = torch.randn(1, 4, cfg.hidden).requires_grad_()
    cos, sin = rope_cos_sin(cfg, torch.arange(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block(x, cos, sin).dtype == torch.float32
    planned = layer_activation_bytes(cfg, 1000, Layout(), FIVEFOLD)["total"] / 1000
    assert planned == pytest.approx(measured, rel=0.05)
