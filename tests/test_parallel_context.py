"""Context parallel: the LSE attention wrapper, zig-zag sharding, ring attention and the whole model under cp,
each against a single-process reference; the balance of attention work per rank against a closed form.

Tolerances: fp32 throughout. Ring attention sums the same terms as single-process attention in another
order (block by block, merged through exp(lse) rescaling), so results differ by rounding only: a few ulp of
the values' scale, well under 1e-5 absolute for attention outputs and gradients of order 1.
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distributed import run_ranks
from fivefold.config import ConfigError
from fivefold.models.llama import build_model
from fivefold.parallel import context
from fivefold.parallel.attention_ops import attention_backward, attention_forward, expand_kv_heads, sum_kv_head_grads
from fivefold.parallel.context import (
    apply_context_parallel,
    attention_blocks,
    check_sequence_length,
    rank_positions,
    ring_attention,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)
from fivefold.presets import get_preset

ATOL = 1e-5


def reference_attention(q, k, v, causal):
    """Explicit softmax attention in float64: (out, lse)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).float(), scores.logsumexp(-1).float()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_ops_match_softmax_and_sdpa(causal, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 24, 16, requires_grad=True)
    k = torch.randn(2, kv_heads, 24 if causal else 40, 16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out, lse = attention_forward(q.detach(), k.detach(), v.detach(), causal)
    ref_out, ref_lse = reference_attention(q.detach(), k.detach(), v.detach(), causal)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)

    grad_out = torch.randn_like(out)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 4)
    expected = torch.autograd.grad(sdpa, (q, k, v), grad_out)
    got = attention_backward(grad_out, q.detach(), k.detach(), v.detach(), out, lse, causal)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)


def test_expanded_kv_heads_match_grouped_query_attention():
    # the accelerator path repeats key/value heads for the kernel and sums their gradients back: on CPU,
    # the same with the kernel's native grouped-query heads is the reference
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    grad_out = torch.randn(1, 6, 16, 8)
    out, lse = attention_forward(q, k, v, True)
    k6, v6 = expand_kv_heads(k, 6), expand_kv_heads(v, 6)
    out6, lse6 = attention_forward(q, k6, v6, True)
    torch.testing.assert_close(out6, out, atol=ATOL, rtol=0)
    grads = attention_backward(grad_out, q, k, v, out, lse, True)
    dq6, dk6, dv6 = attention_backward(grad_out, q, k6, v6, out6, lse6, True)
    for got, expected in zip((dq6, sum_kv_head_grads(dk6, 2), sum_kv_head_grads(dv6, 2)), grads, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accelerator_kernel_path_signatures_on_meta(dtype):
    # the meta device takes the non-CPU path through the aten kernels' shape functions: argument order and
    # shapes only (the numbers are checked on CPU above; on a GPU, the same tests with device tensors)
    q = torch.empty(2, 4, 40, 16, device="meta", dtype=dtype)
    for kv_len, causal in ((40, True), (24, False)):
        k = torch.empty(2, 2, kv_len, 16, device="meta", dtype=dtype)
        out, lse = attention_forward(q, k, k, causal)
        assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
        grads = attention_backward(torch.empty_like(out), q, k, k, out, lse, causal)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_shard_and_unshard_are_inverse_and_positions_follow_the_tokens():
    x = torch.arange(3 * 16).view(3, 16)
    for layout in ("zigzag", "contiguous"):
        shards = [shard_sequence(x, r, 4, layout) for r in range(4)]
        assert torch.equal(unshard_sequence(shards, layout), x)
        for r in range(4):
            assert torch.equal(shards[r][0], rank_positions(16, r, 4, layout))
    # zig-zag on 4 ranks of 16 tokens: chunks of 2, rank 1 keeps chunks 1 and 6
    assert rank_positions(16, 1, 4).tolist() == [2, 3, 12, 13]


def test_sequence_not_divisible_by_2cp_is_refused_with_nearest_lengths():
    with pytest.raises(ConfigError, match=r"train.seq_len = 100 .* cp = 4.* multiple of 8.*96, 104"):
        check_sequence_length(100, 4)
    with pytest.raises(ConfigError, match=r"nearest valid lengths: 4$"):
        check_sequence_length(2, 2)
    check_sequence_length(96, 4)
    with pytest.raises(ConfigError, match="2\\*cp = 4"):
        shard_batch(torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 10, dtype=torch.long), 0, 2)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_attention_work_and_contiguous_does_not(cp):
    chunks = 2 * cp
    # the closed form: causal attention over 2*cp chunks is the lower triangle of chunk pairs,
    # the diagonal ones causal (half the work)
    triangle = {(i, j, "causal" if i == j else "full") for i in range(chunks) for j in range(i + 1)}
    for layout in ("zigzag", "contiguous"):
        per_rank = [attention_blocks(r, cp, layout) for r in range(cp)]
        flat = [b for blocks in per_rank for b in blocks]
        assert len(flat) == len(set(flat)) and set(flat) == triangle  # every block once, none masked computed
        work = [sum(1.0 if kind == "full" else 0.5 for _, _, kind in blocks) for blocks in per_rank]
        if layout == "zigzag":
            assert work == [2 * cp] * cp  # (2cp)^2 / 2 block-units shared equally
        else:
            assert work == [4 * r + 2 for r in range(cp)]  # rank r: its 2 diagonal chunks + 4 per earlier rank
            assert max(work) / min(work) == 2 * cp - 1


def _portable(t: torch.Tensor):
    """A rank's result as a numpy array: pickled by value, so it outlives the rank's process (a tensor goes
    through shared memory that vanishes when the rank exits first)."""
    return t.numpy()


def _attention_inputs(seed, cp, kv_heads):
    """q, k, v and the output gradient of one full sequence: [batch, heads, 8 * cp, head_dim]."""
    torch.manual_seed(seed)
    b, heads, seq, dim = 2, 4, 8 * cp, 16
    return [torch.randn(b, h, seq, dim) for h in (heads, kv_heads, kv_heads, heads)]


def _ring_vs_sdpa(rank, world_size, kv_heads, layouts, cp_groups):
    groups = [dist.new_group(ranks) for ranks in cp_groups]  # every rank creates every group
    index = next(i for i, ranks in enumerate(cp_groups) if rank in ranks)
    group, cp, cp_rank = groups[index], len(cp_groups[index]), cp_groups[index].index(rank)
    q, k, v, grad_out = _attention_inputs(index, cp, kv_heads)  # each cp group its own sequence
    chunk = q.shape[2] // (2 * cp)
    results = {}
    for layout in layouts:
        work = []  # the attention kernel calls that really run, in chunk-pair units (causal = half)

        def counting_forward(q, k, v, causal, work=work):
            work.append(q.shape[2] * k.shape[2] / chunk**2 / (2 if causal else 1))
            return attention_forward(q, k, v, causal)

        shard = [shard_sequence(t, cp_rank, cp, layout, dim=2).requires_grad_() for t in (q, k, v)]
        with patch.object(context, "attention_forward", counting_forward):
            out = ring_attention(*shard, group, layout)
        out.backward(shard_sequence(grad_out, cp_rank, cp, layout, dim=2))
        serial_out, _ = context.ring_attention_forward(*(t.detach() for t in shard), group, layout, overlap=False)
        tensors = (out, shard[0].grad, shard[1].grad, shard[2].grad, serial_out)
        results[layout] = ([_portable(t.detach()) for t in tensors], sum(work))
    return results


def check_ring_attention(cp_groups, kv_heads, layouts=("zigzag", "contiguous")):
    results = run_ranks(sum(map(len, cp_groups)), _ring_vs_sdpa, kv_heads, layouts, cp_groups)
    for index, ranks in enumerate(cp_groups):
        cp = len(ranks)
        q, k, v, grad_out = _attention_inputs(index, cp, kv_heads)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != q.shape[1])
        ref.backward(grad_out)
        for layout in layouts:
            for i, expected in enumerate((ref, q.grad, k.grad, v.grad, ref)):  # the last: transfers serialised
                got = unshard_sequence([torch.from_numpy(results[r][layout][0][i]) for r in ranks], layout, dim=2)
                torch.testing.assert_close(got, expected.detach(), atol=ATOL, rtol=0)
            # the balance, counted on the kernel calls that ran: the closed form of test_zigzag_balances_...
            work = [results[r][layout][1] for r in ranks]
            assert work == ([2 * cp] * cp if layout == "zigzag" else [4 * r + 2 for r in range(cp)])


def test_ring_attention_cp2_matches_sdpa():
    check_ring_attention([[0, 1]], kv_heads=2)  # grouped-query: 4 query heads over 2 key/value heads


def test_ring_attention_on_strided_cp_subgroups():
    # dp2 x cp2 with cp the outer axis: the ring's neighbours are global ranks two apart
    check_ring_attention([[0, 2], [1, 3]], kv_heads=2, layouts=("zigzag",))


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ring_attention_cp4_matches_sdpa(kv_heads):
    check_ring_attention([[0, 1, 2, 3]], kv_heads)


def _model_step(rank, world_size, tokens, targets):
    cfg = get_preset("tiny")
    model = build_model(cfg, seed=0)
    if world_size > 1:
        apply_context_parallel(model, dist.group.WORLD)
        tokens, targets, positions = shard_batch(tokens, targets, rank, world_size)
    else:
        positions = None
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}  # storage -> bytes of every activation autograd keeps for backward

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), 0 if t.untyped_storage().data_ptr() in weights
                         else t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return loss.item(), _portable(grads), sum(saved.values())


def test_tiny_model_under_cp2_matches_single_process():
    torch.manual_seed(1)
    cfg = get_preset("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    targets = torch.randint(0, cfg.vocab_size, (2, 32))
    ref_loss, ref_grads, ref_saved = _model_step(0, 1, tokens, targets)
    ref_grads = torch.from_numpy(ref_grads)
    results = run_ranks(2, _model_step, tokens, targets)
    # each rank holds the loss and the gradients of its tokens: summed over cp they are the whole batch's,
    # as the engine's all-reduce over dp x cp will sum them
    assert abs(sum(r[0] for r in results) - ref_loss) <= 1e-5 * abs(ref_loss)
    names = [n for n, _ in build_model(get_preset("tiny"), device="meta").named_parameters()]
    shapes = [p.numel() for p in build_model(get_preset("tiny"), device="meta").parameters()]
    grads = sum(torch.from_numpy(r[1]) for r in results)
    for name, got, expected in zip(names, grads.split(shapes), ref_grads.split(shapes), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    # every saved activation is per token, ring attention's included: each cp rank keeps half of them
    for r in results:
        assert r[2] <= 0.5 * ref_saved * 1.01, (r[2], ref_saved, r[2] / ref_saved)


class _Recomputed(torch.nn.Module):
    """A block whose activations are recomputed in backward (the recompute the engine applies per block)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin, mask=None):
        return checkpoint(self.block, x, cos, sin, mask, use_reentrant=False)


def _wrapped_blocks_step(rank, world_size, tokens, wrap):
    model = build_model(get_preset("tiny"), seed=0)
    apply_context_parallel(model, dist.group.WORLD)
    for name, block in model.layers.items():
        if wrap == "compile":
            block.compile()
        elif wrap == "recompute":
            model.layers[name] = _Recomputed(block)
    inputs, _, positions = shard_batch(tokens, tokens, rank, world_size)
    out = model(inputs, positions)
    out.square().mean().backward()
    return _portable(out.detach()), _portable(torch.cat([p.grad.flatten() for p in model.parameters()]))


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["compile", "recompute"])
def test_compiled_or_recomputed_blocks_with_ring_attention_match_eager(wrap):
    tokens = torch.randint(0, get_preset("tiny").vocab_size, (1, 32), generator=torch.Generator().manual_seed(2))
    eager = run_ranks(2, _wrapped_blocks_step, tokens, None)
    wrapped = run_ranks(2, _wrapped_blocks_step, tokens, wrap)
    for e, w in zip(eager, wrapped, strict=True):
        torch.testing.assert_close(torch.from_numpy(w[0]), torch.from_numpy(e[0]), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.from_numpy(w[1]), torch.from_numpy(e[1]), atol=1e-5, rtol=1e-4)


def ring_transfers_under_recompute(rank: int, world_size: int) -> dict:
    """One step of the tiny model under cp2 in each recompute mode: the loss, the gradient norm and the ring's
    transfers (`ring_shift` calls)."""
    from tests.test_parallel_equivalence import step_in_each_recompute_mode

    import fivefold.parallel.context as context

    return step_in_each_recompute_mode(rank, {"layout.cp": "2"}, context, "ring_shift")


def test_selective_recompute_passes_nothing_around_the_ring_again():
    """Selective recompute keeps ring attention's output and log-sum-exp (`RingAttention` with the block's
    `CollectiveStore`): its step makes exactly the ring transfers of a step without recompute (per layer under cp2: 1
    key/value hop forward; 1 key/value hop and 2 gradient hops backward), where full recompute makes the forward's
    hop again; the loss and the gradient norm equal those without recompute."""
    layers = 2
    for out in run_ranks(2, ring_transfers_under_recompute):
        (loss, norm, none), (_, _, selective), (_, _, full) = out["none"], out["selective"], out["full"]
        assert none == selective == 4 * layers
        assert full == none + layers
        for mode in ("selective", "full"):
            assert out[mode][0] == pytest.approx(loss, rel=1e-6)
            assert out[mode][1] == pytest.approx(norm, rel=1e-5)
