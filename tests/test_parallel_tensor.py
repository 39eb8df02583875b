"""Tensor parallelism, sequence parallelism and activation recompute against one process.

The reference is the plain model in one process (same seed, same tokens) with `F.cross_entropy` over its
full logits. On 2 gloo ranks, the tp2 (and tp2 + SP) loss and every gathered gradient must match it.

Tolerance: 1e-5 relative (norm of the difference over the norm of the reference), in fp32. TP changes only
the order of floating-point sums (a row-parallel matmul sums two halves of the contraction, then the
all-reduce adds them; the loss sums the softmax denominator over vocab halves), so the expected error is
a few ulps of fp32 accumulated over 4 layers: about 1e-7 to 1e-6. Replicated parameters must get bitwise
identical gradients on both ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from distributed import run_ranks
from fivefold.config import ConfigError
from fivefold.models.llama import build_model
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.tensor import (
    apply_tensor_parallel,
    gather_state,
    shard_state,
    tp_shard_dim,
    validate_tensor_parallel,
    vocab_parallel_loss_sum,
)
from fivefold.presets import get_preset

TOL = 1e-5


def batch(vocab: int, rows: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (rows, seq), generator=gen)
    targets = torch.randint(0, vocab, (rows, seq), generator=gen)
    targets[0, :3] = -100  # ignored targets
    return tokens, targets


def model_config(preset: str, overrides: dict | None = None):
    return dataclasses.replace(get_preset(preset), **(overrides or {}))


def reference(preset: str, overrides: dict | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = model_config(preset, overrides)
    model = build_model(cfg, "cpu", seed=0)
    tokens, targets = batch(cfg.vocab_size)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100)
    if cfg.is_moe:
        loss = loss + cfg.aux_loss_coef * model.moe_aux_loss() * targets.numel()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class TPLoss(torch.nn.Module):
    """The model and its tp loss as one module (a `fully_shard` root runs its hooks around `forward`)."""

    def __init__(self, model: torch.nn.Module, sequence_parallel: bool) -> None:
        super().__init__()
        self.model, self.sequence_parallel = model, sequence_parallel

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.model.forward_hidden(tokens)
        loss = vocab_parallel_loss_sum(self.model, hidden, targets, dist.group.WORLD, self.sequence_parallel,
                                       chunk_tokens=12)  # 3 chunks
        cfg = self.model.cfg
        if cfg.is_moe:
            loss = loss + cfg.aux_loss_coef * self.model.moe_aux_loss() * targets.numel()
        return loss


def wrap_in_fully_shard(loss_model: TPLoss, rank: int, world_size: int) -> None:
    """`fully_shard` over a one-rank mesh: it swaps every parameter for a DTensor, as ZeRO-3 would."""
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    mesh = DeviceMesh.from_group(singles[rank], "cpu")
    for block in loss_model.model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(loss_model, mesh=mesh)


def tp_loss_and_grad_errors(rank: int, world_size: int, preset: str, variants: list[tuple[bool, str]],
                            overrides: dict | None = None, parameter_wrapper: bool = False) -> list[dict]:
    """On each rank: for each (sequence_parallel, recompute), the tp loss and gathered gradients against
    the single-process reference."""
    group = dist.group.WORLD
    cfg = model_config(preset, overrides)
    tokens, targets = batch(cfg.vocab_size)
    ref_loss, ref_grads = reference(preset, overrides)
    results = []
    for sp, recompute in variants:
        model = build_model(cfg, "cpu", seed=0)
        apply_tensor_parallel(model, group, sequence_parallel=sp)
        apply_recompute(model, recompute)
        loss_model = TPLoss(model, sp)
        if parameter_wrapper:
            wrap_in_fully_shard(loss_model, rank, world_size)
        loss = loss_model(tokens, targets)
        loss.backward()
        local_grads = {n: p.grad.to_local() if parameter_wrapper else p.grad for n, p in model.named_parameters()}
        grads = gather_state(local_grads, group)
        errors = {n: rel_err(g, ref_grads[n]) for n, g in grads.items()}
        replicated_equal = True
        for n, g in local_grads.items():
            if tp_shard_dim(n) is None:
                copies = [torch.empty_like(g) for _ in range(world_size)]
                dist.all_gather(copies, g)
                replicated_equal &= all(torch.equal(c, copies[0]) for c in copies)
        results.append(dict(sp=sp, recompute=recompute, loss=loss.item(), ref_loss=ref_loss, errors=errors,
                            names=sorted(grads) == sorted(ref_grads), replicated_equal=replicated_equal))
    return results


def check_tp_results(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            label = f"sp={r['sp']} recompute={r['recompute']}"
            assert r["names"], label
            assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), label
            worst = max(r["errors"], key=r["errors"].get)
            assert r["errors"][worst] < TOL, f"{label}: {worst} gradient off by {r['errors'][worst]:.2e}"
            assert r["replicated_equal"], label
    # the loss is the same value on every tp rank
    for per_variant in zip(*results, strict=True):
        assert len({r["loss"] for r in per_variant}) == 1


def test_tp2_dense_matches_single_process():
    results = run_ranks(2, tp_loss_and_grad_errors, "tiny",
                        [(False, "none"), (True, "none"), (False, "full"), (True, "selective")])
    check_tp_results(results)


def test_tp2_moe_untied_matches_single_process():
    """The MoE model with an untied output layer (the dense test covers tied embeddings)."""
    results = run_ranks(2, tp_loss_and_grad_errors, "tiny-moe", [(False, "none"), (True, "full")],
                        dict(tied_embeddings=False))
    check_tp_results(results)


def test_tp2_sp_under_a_parameter_swapping_wrapper():
    """`fully_shard` replaces every `nn.Parameter`; the SP norm gradients must still be completed over tp."""
    results = run_ranks(2, tp_loss_and_grad_errors, "tiny-moe", [(True, "full")], None, True)
    check_tp_results(results)


def overlap_grads_and_launches(rank: int, world_size: int) -> dict:
    """On each rank: the tp2 + sp model's loss and gradients with sequence parallel's collectives overlapped and
    not, the asynchronous all-gathers and reduce-scatters each launched (counted around `tensor_comm`'s two
    collectives) and the sequence length."""
    from fivefold.parallel import tensor_comm

    cfg = model_config("tiny")
    tokens, targets = batch(cfg.vocab_size)
    launched = {"gather": 0, "scatter": 0}
    gather_into, scatter_into = tensor_comm.all_gather_into, tensor_comm.reduce_scatter_into

    def counting_gather(*args, async_op=False, **kwargs):
        launched["gather"] += async_op
        return gather_into(*args, async_op=async_op, **kwargs)

    def counting_scatter(*args, async_op=False, **kwargs):
        launched["scatter"] += async_op
        return scatter_into(*args, async_op=async_op, **kwargs)

    tensor_comm.all_gather_into, tensor_comm.reduce_scatter_into = counting_gather, counting_scatter
    out = {}
    try:
        for overlap in (True, False):
            launched.update(gather=0, scatter=0)
            model = build_model(cfg, "cpu", seed=0)
            apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=True, comm_overlap=overlap)
            loss = TPLoss(model, True)(tokens, targets)
            loss.backward()
            out[overlap] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, dict(launched))
    finally:
        tensor_comm.all_gather_into, tensor_comm.reduce_scatter_into = gather_into, scatter_into
    return out, tokens.shape[1]


def test_sequence_parallel_overlap_launches_async_collectives_and_changes_nothing():
    """`apply_tensor_parallel(..., comm_overlap=True)` (`layout.tp_comm_overlap`): every collective of a block's
    sequence parallel is asynchronous. Per block, forward: the two gathered linears' (q/k/v, gate/up) input
    all-gathers under their own rows' matmuls and the two row linears' (o, down) reduce-scatters in
    `SCATTER_PIECES` pieces; backward: the row linears' output-gradient all-gathers, the gathered linears'
    input all-gathers and input-gradient reduce-scatters. The loss is the same and every gradient the same within
    float rounding (the row linears' weight gradients sum the ranks' rows in two matmuls)."""
    from fivefold.layout import SCATTER_PIECES

    cfg = model_config("tiny")
    for out, seq in run_ranks(2, overlap_grads_and_launches):
        (loss_on, grads_on, launched_on), (loss_off, grads_off, launched_off) = out[True], out[False]
        pieces = SCATTER_PIECES if (seq // 2) % SCATTER_PIECES == 0 else 1
        assert pieces == SCATTER_PIECES  # the batch exercises the pieces
        assert launched_on == {"gather": 6 * cfg.n_layers, "scatter": (2 * pieces + 2) * cfg.n_layers}
        assert launched_off == {"gather": 0, "scatter": 0}
        assert abs(loss_on - loss_off) <= 1e-6 * abs(loss_off)
        for name, grad in grads_off.items():
            torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def backward_collectives_under_recompute(rank: int, world_size: int) -> dict:
    """On each rank: per recompute mode, the tp2 + sp (overlapped) model's loss, gradients and the all-gathers and
    reduce-scatters that its backward launches (counted around `tensor_comm`'s two collectives)."""
    from fivefold.parallel import tensor_comm

    cfg = model_config("tiny")
    tokens, targets = batch(cfg.vocab_size)
    launched = {"gather": 0, "scatter": 0}
    gather_into, scatter_into = tensor_comm.all_gather_into, tensor_comm.reduce_scatter_into

    def counting(kind, inner):
        def call(*args, **kwargs):
            launched[kind] += 1
            return inner(*args, **kwargs)
        return call

    out = {}
    try:
        for mode in ("none", "selective", "full"):
            model = build_model(cfg, "cpu", seed=0)
            apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=True, comm_overlap=True)
            apply_recompute(model, mode)
            loss = TPLoss(model, True)(tokens, targets)
            launched.update(gather=0, scatter=0)
            tensor_comm.all_gather_into = counting("gather", gather_into)
            tensor_comm.reduce_scatter_into = counting("scatter", scatter_into)
            loss.backward()
            tensor_comm.all_gather_into, tensor_comm.reduce_scatter_into = gather_into, scatter_into
            out[mode] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, dict(launched))
    finally:
        tensor_comm.all_gather_into, tensor_comm.reduce_scatter_into = gather_into, scatter_into
    return out


def test_selective_recompute_runs_no_overlapped_collective_again():
    """Selective recompute keeps the overlapped sequence-parallel linears' collective outputs (`CollectiveStore`):
    its backward launches exactly the all-gathers and reduce-scatters of a backward without recompute (6 per block:
    the gathered linears' input all-gather and input-gradient reduce-scatter, the row linears' output-gradient
    all-gather, twice; and the embedding's and the loss's), where full recompute also runs the forward's 2
    all-gathers and 2 x 2 reduce-scatter pieces per block again; the loss and every gradient equal those without
    recompute within float rounding."""
    from fivefold.layout import SCATTER_PIECES

    cfg = model_config("tiny")
    for out in run_ranks(2, backward_collectives_under_recompute):
        (loss, grads, none), (_, _, selective), (_, _, full) = out["none"], out["selective"], out["full"]
        # the blocks' 4 all-gathers and 2 reduce-scatters each, and the embedding's and the loss's one each
        assert none == selective == {"gather": 4 * cfg.n_layers + 1, "scatter": 2 * cfg.n_layers + 1}
        assert full == {"gather": none["gather"] + 2 * cfg.n_layers,
                        "scatter": none["scatter"] + 2 * SCATTER_PIECES * cfg.n_layers}
        for mode in ("selective", "full"):
            assert abs(out[mode][0] - loss) <= 1e-6 * abs(loss)
            for name, grad in grads.items():
                torch.testing.assert_close(out[mode][1][name], grad, rtol=1e-5, atol=1e-6, msg=(mode, name))


@pytest.mark.slow
def test_tp4_matches_single_process():
    """Four ranks, four kv heads, dense and MoE with capacity-based routing, every recompute mode."""
    variants = [(False, "none"), (True, "none"), (True, "selective"), (False, "full")]
    check_tp_results(run_ranks(4, tp_loss_and_grad_errors, "tiny", variants, dict(n_kv_heads=4)))
    check_tp_results(run_ranks(4, tp_loss_and_grad_errors, "tiny-moe", variants,
                               dict(n_kv_heads=4, capacity_factor=1.0)))


def vocab_loss_and_state_round_trip(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", seed=0)
    full_state = {k: v.clone() for k, v in model.state_dict().items()}
    apply_tensor_parallel(model, group, sequence_parallel=False)
    tied = model.lm_head.weight is model.embed.weight
    # the local state is exactly this rank's shard of the full one, and gathers back to it exactly
    local_state = model.state_dict()
    sharded = shard_state(full_state, rank, world_size)
    shards_exact = all(torch.equal(local_state[k], sharded[k]) for k in full_state)
    gathered = gather_state(local_state, group)
    round_trip = all(torch.equal(gathered[k], full_state[k]) for k in full_state)
    # the vocab-parallel loss against F.cross_entropy on full logits, several chunk sizes, ignored targets
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 10, cfg.hidden, generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (3, 10), generator=gen)
    targets[1, 4:] = -100
    expected = F.cross_entropy(hidden.flatten(0, 1) @ full_state["lm_head.weight"].t(), targets.flatten(),
                               reduction="sum", ignore_index=-100).item()
    losses = [vocab_parallel_loss_sum(model, hidden, targets, group, False, chunk_tokens=c).item()
              for c in (1, 7, 4096)]
    seq_hidden = hidden.chunk(world_size, 1)[rank]  # under SP the hidden states arrive sequence-sharded
    sp_loss = vocab_parallel_loss_sum(model, seq_hidden, targets, group, True).item()
    # a sequence that does not split over the tp ranks is refused by sequence parallelism
    sp_model = build_model(cfg, "cpu", seed=0)
    apply_tensor_parallel(sp_model, group, sequence_parallel=True)
    try:
        sp_model.forward_hidden(torch.zeros(1, 9, dtype=torch.long))
        odd_seq_error = ""
    except ValueError as e:
        odd_seq_error = str(e)
    return dict(tied=tied, shards_exact=shards_exact, round_trip=round_trip, expected=expected, losses=losses,
                sp_loss=sp_loss, odd_seq_error=odd_seq_error)


def test_vocab_parallel_loss_and_state_round_trip():
    results = run_ranks(2, vocab_loss_and_state_round_trip)
    for r in results:
        assert r["tied"] and r["shards_exact"] and r["round_trip"]
        assert "sequence length is 9; use a sequence length divisible by 2" in r["odd_seq_error"]
        for loss in [*r["losses"], r["sp_loss"]]:
            assert abs(loss - r["expected"]) <= TOL * abs(r["expected"])
    assert results[0]["losses"] == results[1]["losses"]


def test_shard_dims_of_plain_names():
    assert tp_shard_dim("layers.0.attn.q_proj.weight") == 0
    assert tp_shard_dim("layers.3.attn.o_proj.weight") == 1
    assert tp_shard_dim("layers.0.mlp.down_proj.weight") == 1
    assert tp_shard_dim("layers.0.mlp.shared.up_proj.weight") == 0
    assert tp_shard_dim("layers.0.mlp.w_gate") == 2 and tp_shard_dim("layers.0.mlp.w_down") == 1
    assert tp_shard_dim("embed.weight") == 0 and tp_shard_dim("lm_head.weight") == 0
    for replicated in ("layers.0.attn_norm.weight", "norm.weight", "layers.0.mlp.router.weight"):
        assert tp_shard_dim(replicated) is None


@pytest.mark.parametrize("field, value, tp", [("n_heads", 6, 4), ("n_kv_heads", 1, 2), ("ffn", 385, 2),
                                             ("vocab_size", 2049, 2)])
def test_tp_not_dividing_a_dim_is_refused(field, value, tp):
    cfg = get_preset("tiny")
    setattr(cfg, field, value)
    if field == "n_heads":
        cfg.hidden = 192
    with pytest.raises(ConfigError, match=rf"layout.tp = {tp} does not divide model.{field} = {value}.*valid tp"):
        validate_tensor_parallel(cfg, tp)


def test_moe_expert_ffn_not_divisible_is_refused():
    cfg = get_preset("tiny-moe")
    cfg.moe_ffn = 129
    with pytest.raises(ConfigError, match="model.moe_ffn = 129"):
        validate_tensor_parallel(cfg, 2)


# --- recompute (one process) ----------------------------------------------------------------------------

def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct activation storages autograd keeps for the backward of `forward_hidden` (saved
    tensors that are not parameters), and the hidden states."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.forward_hidden(tokens)
    return sum(storages.values()), hidden


def saved_bytes_and_grads(mode: str, rows: int, seq: int, held: bool = False) -> tuple[
    int, dict[str, torch.Tensor]
]:
    """Saved activation bytes (autograd's saved tensors; with `held`, also what selective recompute's cache
    keeps, see tests/test_recompute.py) and the gradients of one step."""
    from tests.test_recompute import held_bytes

    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu", seed=0)
    apply_recompute(model, mode)
    tokens, targets = batch(cfg.vocab_size, rows, seq)
    if held:
        exclude = {t.untyped_storage().data_ptr() for t in [tokens, *model.parameters()]}
        saved, hidden = held_bytes(lambda: model.forward_hidden(tokens), exclude)
    else:
        saved, hidden = saved_activation_bytes(model, tokens)
    F.cross_entropy(model.lm_head(hidden).flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    return saved, {n: p.grad for n, p in model.named_parameters()}


def tp_saved_activation_bytes(rank: int, world_size: int, rows: int, seq: int) -> dict[bool, int]:
    cfg = get_preset("tiny")
    tokens, _ = batch(cfg.vocab_size, rows, seq)
    saved = {}
    for sp in (False, True):
        model = build_model(cfg, "cpu", seed=0)
        apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
        saved[sp] = saved_activation_bytes(model, tokens)[0]
    return saved


def test_sequence_parallel_shards_norm_and_residual_activations():
    """SP keeps 1/tp of what the norm regions save: per block norm its input and output (the input of the
    column-parallel linears, which under SP keep only their slice) and the per-row rsqrt; for the final norm its
    input and the rsqrt. Everything else is the same as TP."""
    cfg, rows, seq, tp = get_preset("tiny"), 2, 64, 2
    hidden, row = rows * seq * cfg.hidden * 4, rows * seq * 4
    norm_region_bytes = 2 * cfg.n_layers * (2 * hidden + row) + (hidden + row)
    for saved in run_ranks(tp, tp_saved_activation_bytes, rows, seq):
        assert saved[False] - saved[True] == norm_region_bytes * (tp - 1) // tp


def test_recompute_same_grads_and_fewer_saved_bytes():
    cfg = get_preset("tiny")
    rows, seq = 2, 64
    none_bytes, none_grads = saved_bytes_and_grads("none", rows, seq)
    none_held, _ = saved_bytes_and_grads("none", rows, seq, held=True)
    sel_bytes, sel_grads = saved_bytes_and_grads("selective", rows, seq, held=True)
    full_bytes, full_grads = saved_bytes_and_grads("full", rows, seq)
    for grads in (sel_grads, full_grads):
        for name, g in grads.items():
            assert torch.allclose(g, none_grads[name], rtol=0, atol=0), name
    # selective recompute keeps the block input and the matmul and attention outputs (q, k, v, attention, o,
    # gate, up, down) instead of the norms' inputs, 1/rms and outputs and the four SwiGLU tensors: h + 2 + 2 f
    # fp32 values fewer per token and layer (docs/parallelism.md)
    h, f = cfg.hidden, cfg.ffn
    assert none_held - sel_bytes == cfg.n_layers * rows * seq * 4 * (h + 2 + 2 * f)
    # full keeps one hidden state per block (its input) plus the final norm's input, the tokens,
    # cos/sin and the norm's per-row statistic
    hidden_bytes = rows * seq * cfg.hidden * 4
    assert full_bytes == (cfg.n_layers + 1) * hidden_bytes + rows * seq * (8 + 4) + 2 * seq * cfg.head_dim * 4
    assert full_bytes < none_bytes / 5


def test_selective_recompute_frees_attention_matrix_with_math_kernel():
    cfg = get_preset("tiny")
    rows, seq = 2, 64
    with sdpa_kernel(SDPBackend.MATH):
        none_bytes, none_grads = saved_bytes_and_grads("none", rows, seq, held=True)
        sel_bytes, sel_grads = saved_bytes_and_grads("selective", rows, seq, held=True)
    # the math kernel keeps the softmax matrix [rows, heads, seq, seq] (at least) per layer
    assert none_bytes - sel_bytes >= cfg.n_layers * rows * cfg.n_heads * seq * seq * 4
    for name, g in sel_grads.items():
        assert torch.equal(g, none_grads[name]), name


def test_recompute_rejects_unknown_mode():
    model = build_model(get_preset("tiny"), "meta")
    with pytest.raises(ValueError, match="layout.recompute = 'partial'"):
        apply_recompute(model, "partial")
