"""What a block compiled by `torch.compile` (`train.compile`, the engine's `block.compile()`) saves for backward,
against the planner's count for a compiled run (`--features compile`, `Framework.compiled_saves_less`).

The partitioner keeps less than eager mode in the MLP (SwiGLU's silu(gate) is recomputed in backward; the routed
experts' output is kept once; the router logits in bf16) and, under sequence parallel, keeps the column linears'
gathered input instead of gathering it again. The GPU runs showed the difference first (the planner predicted the
8B example's rank 13.6 % above what it held, OLMoE's 22 %); these tests measure it on the CPU: the distinct
storages autograd saves during one compiled forward of a bf16 block (its input included, parameters and rotary
tables not), after a first forward and backward built the graphs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.distributed import run_ranks

from fivefold.models.llama import build_model, rope_cos_sin
from fivefold.planner.features import with_features
from fivefold.planner.layout import FIVEFOLD, Layout
from fivefold.planner.memory import layer_activation_bytes
from fivefold.presets import get_preset

SEQ = 64
DENSE = dict(n_layers=1, hidden=256, n_heads=2, n_kv_heads=2, ffn=768, vocab_size=256, tied_embeddings=False)
MOE = dict(n_layers=1, hidden=256, n_heads=2, n_kv_heads=2, ffn=128, vocab_size=256, tied_embeddings=False)


def saved_bytes(cfg, compiled: bool, local_seq: int, tp_group=None, overlap: bool = False) -> int:
    """Saved-for-backward bytes of one forward of the model's one bf16 block over `local_seq` input rows."""
    model = build_model(cfg, "cpu", seed=0)
    if tp_group is not None:
        from fivefold.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, tp_group, sequence_parallel=True, comm_overlap=overlap)
    model.to(torch.bfloat16)
    block = model.layers["0"]
    if compiled:
        torch.compiler.reset()
        block.compile()
    x = torch.randn(1, local_seq, cfg.hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()
    cos, sin = (t.to(torch.bfloat16) for t in rope_cos_sin(cfg, torch.arange(SEQ)))
    skip = {t.untyped_storage().data_ptr() for t in (cos, sin, *model.parameters())}
    seen: dict[int, int] = {}
    for _ in range(2):  # the first pass compiles; the second is the one counted
        seen.clear()

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x, cos, sin, None)
        counted = sum(n for ptr, n in seen.items() if ptr not in skip and ptr != out.untyped_storage().data_ptr())
        out.float().square().sum().backward()
    return counted


def planned(cfg, lay: Layout, compiled: bool) -> float:
    fw = with_features(FIVEFOLD, ("compile",)) if compiled else FIVEFOLD
    return layer_activation_bytes(cfg, SEQ, lay, fw)["total"]


@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_a_compiled_block_saves_what_the_planner_counts(shape):
    if shape == "dense":
        cfg = dataclasses.replace(get_preset("tiny"), **DENSE)
    else:  # OLMoE's routing (64 experts, top-8) at a small width, dropless grouped experts
        cfg = dataclasses.replace(get_preset("olmoe-1b-7b"), **MOE)
    eager, compiled = saved_bytes(cfg, False, SEQ), saved_bytes(cfg, True, SEQ)
    # the planner's eager count holds as before, and its compiled count follows the compiled block
    assert planned(cfg, Layout(), False) == pytest.approx(eager, rel=0.02)
    assert planned(cfg, Layout(), True) == pytest.approx(compiled, rel=0.02)
    # and the difference is real: compiled keeps a sixth (dense) to a quarter (MoE) less at these shapes
    assert compiled < 0.9 * eager


def compiled_tp_sp_bytes(rank: int, world_size: int, overlap: bool) -> tuple[int, int]:
    import torch.distributed as dist

    cfg = dataclasses.replace(get_preset("tiny"), **DENSE)
    return (saved_bytes(cfg, False, SEQ // world_size, dist.group.WORLD, overlap),
            saved_bytes(cfg, True, SEQ // world_size, dist.group.WORLD, overlap))


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])  # the default fast
def test_a_compiled_block_under_tp2_and_sp_keeps_the_gathered_input(overlap):
    """With the gathered linears' backward overlapped (`layout.tp_comm_overlap`, the default) and without."""
    cfg = dataclasses.replace(get_preset("tiny"), **DENSE)
    lay = Layout(tp=2, sp=True, tp_comm_overlap=overlap)
    # the two norm outputs kept gathered (2 x 2h per token of the whole sequence; eager keeps the slice)
    gathered = 2 * 2 * cfg.hidden * (SEQ - SEQ // 2)
    for eager, compiled in run_ranks(2, compiled_tp_sp_bytes, overlap):
        assert planned(cfg, lay, False) == pytest.approx(eager, rel=0.02)
        # sequential backward: the gathered input is kept, which outweighs the product recomputed (2 x ffn / tp)
        # at this width. Overlapped, the CPU's compile keeps the slice; on the H200 the 70B example's first rank
        # held 72.24 GiB with the overlap on and off alike (docs/benchmarks.md), so the planner counts the gathered
        # input either way, on the safe side here
        kept = 0 if overlap else gathered
        assert compiled - eager == pytest.approx(kept - 2 * (cfg.ffn // 2) * SEQ, rel=0.02)
        assert planned(cfg, lay, True) == pytest.approx(compiled + gathered - kept, rel=0.02)
