"""The memory conventions of torchtitan's framework profile (`planner/frameworks/torchtitan.toml`) against closed
forms of what its code allocates: the whole-batch loss as the caching allocator reserves it, and the tensors its
op-level selective recompute keeps (eager, and under torch.compile)."""

from __future__ import annotations

import collections
import dataclasses
import functools

import pytest
import torch
from tests.test_recompute import held_bytes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fivefold.config import ConfigError
from fivefold.planner.features import with_features
from fivefold.planner.layout import FIVEFOLD, NANOTRON, Layout
from fivefold.planner.memory import layer_activation_bytes, loss_peak_bytes, rank_memory
from fivefold.planner.profile import all_frameworks
from fivefold.presets import get_preset

TT = all_frameworks()["torchtitan"]


def test_torchtitan_loss_is_whole_batch_and_reserved():
    """No chunking: tokens x vocabulary x 14 bytes without tp (bf16 logits 2, fp32 copy 4, log-softmax 4, the
    backward's input gradient in a block of its own 4), tokens x vocabulary / tp x 18 under loss parallel."""
    cfg = get_preset("llama3-8b")
    lay = Layout(dp=8, zero=3, micro_batch_size=2, grad_accum_steps=1, recompute="none")
    tokens = 2 * 8192
    got = rank_memory(cfg, 8192, lay, TT, 1.0).parts["transient"]
    assert got == tokens * cfg.vocab_size * 14
    tp = dataclasses.replace(lay, tp=8, sp=True)
    assert rank_memory(cfg, 8192, tp, TT, 1.0).parts["transient"] == tokens * (cfg.vocab_size // 8) * 18
    assert (loss_peak_bytes(TT, 1), loss_peak_bytes(TT, 8)) == (14.0, 18.0)


def test_loss_peak_defaults_to_logits_bytes():
    """Frameworks that set neither loss field keep `logits_bytes` (nanotron's whole logits, fivefold's chunk)."""
    for fw in (NANOTRON, FIVEFOLD):
        assert loss_peak_bytes(fw, 1) == loss_peak_bytes(fw, 4) == fw.logits_bytes
    cfg = get_preset("llama3-8b")
    lay = Layout(dp=8, tp=2, sp=True, zero=1, micro_batch_size=1, grad_accum_steps=1, recompute="none")
    assert rank_memory(cfg, 4096, lay, NANOTRON, 1.0).parts["transient"] == 4096 * (cfg.vocab_size // 2) * 10.0


def test_torchtitan_op_level_selective_recompute():
    """The op-level policy keeps every other mm of the block (q, v, gate, down: the 1st, 3rd, 5th and 7th), the
    attention kernel's output and fp32 log-sum-exp, and the block input; under compile not down's output."""
    cfg = get_preset("llama3-8b")
    h, d, f = cfg.hidden, cfg.head_dim, cfg.ffn
    heads, kv = cfg.n_heads, cfg.n_kv_heads
    lay = Layout(dp=8, zero=3, micro_batch_size=2, grad_accum_steps=1, recompute="selective")
    tokens = 2 * 8192
    eager = layer_activation_bytes(cfg, tokens, lay, TT)["total"]
    kept = h + heads * d + kv * d + heads * d + f + h  # input, q, v, attention output, gate, down (bf16)
    assert eager == tokens * kept * 2 + tokens * heads * 4
    compiled = layer_activation_bytes(cfg, tokens, lay, with_features(TT, ("compile",)))["total"]
    assert compiled == eager - tokens * h * 2
    # fivefold's policy keeps every matmul output: input, q k v, attention output, o, gate up down
    ff = layer_activation_bytes(cfg, tokens, lay, FIVEFOLD)["total"]
    assert ff == tokens * (h + 2 * heads * d + 2 * kv * d + h + 2 * f + h) * 2 + tokens * heads * 4
    assert layer_activation_bytes(cfg, tokens, lay, with_features(FIVEFOLD, ("compile",)))["total"] == ff


def test_selective_saved_matmuls_are_checked():
    bad = dataclasses.replace(TT, selective_saved_matmuls="q,wq")
    lay = Layout(dp=8, zero=3, recompute="selective")
    with pytest.raises(ConfigError, match="wq"):
        layer_activation_bytes(get_preset("tiny"), 128, lay, bad)


# ---------------------------------------------------------------------------------------------
# The op-level policy on a block laid out as torchtitan's (models/llama/model.py at 9dec370), under torch's own
# selective checkpointing, in fp32 on CPU: what it holds for backward against the planner's count


class _TitanBlock(torch.nn.Module):
    """torchtitan's TransformerBlock: the same modules, called in the same order (rotary as complex products,
    k and v repeated to every head before SDPA)."""

    def __init__(self, h: int, heads: int, kv: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, h // heads
        lin = functools.partial(torch.nn.Linear, bias=False)
        self.wq, self.wk, self.wv, self.wo = lin(h, heads * self.d), lin(h, kv * self.d), lin(h, kv * self.d), lin(
            heads * self.d, h)
        self.w1, self.w2, self.w3 = lin(h, ffn), lin(ffn, h), lin(h, ffn)
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)

    def attention(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        bs, s, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq, xk, xv = xq.view(bs, s, -1, self.d), xk.view(bs, s, -1, self.d), xv.view(bs, s, -1, self.d)
        cq = torch.view_as_complex(xq.float().reshape(bs, s, -1, self.d // 2, 2))
        ck = torch.view_as_complex(xk.float().reshape(bs, s, -1, self.d // 2, 2))
        f = freqs[:s].view(1, s, 1, self.d // 2)
        xq = torch.view_as_real(cq * f).flatten(3).type_as(xq)
        xk = torch.view_as_real(ck * f).flatten(3).type_as(xk)
        rep = self.heads // self.kv
        keys = xk[:, :, :, None, :].expand(bs, s, self.kv, rep, self.d).reshape(bs, s, self.heads, self.d)
        values = xv[:, :, :, None, :].expand(bs, s, self.kv, rep, self.d).reshape(bs, s, self.heads, self.d)
        out = torch.nn.functional.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, s, -1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        y = self.ffn_norm(h)
        return h + self.w2(torch.nn.functional.silu(self.w1(y)) * self.w3(y))


# torchtitan's save list, with the CPU flash kernel standing for the CUDA ones (by name: no private handles)
_TITAN_SAVED = ("aten::mm", "aten::_scaled_dot_product_flash_attention",
                "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
                "_c10d_functional::reduce_scatter_tensor", "aten::abs", "aten::max")


def _titan_contexts():
    """torchtitan's `_get_custom_policy`: save the outputs of the save list except every second mm."""
    meta: dict[str, int] = collections.defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        name = func.name().split(".")[0]
        if name == "aten::mm":
            meta[key] += 1
        save = name in _TITAN_SAVED and not (name == "aten::mm" and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _held(block: _TitanBlock, x: torch.Tensor, freqs: torch.Tensor) -> int:
    """Bytes the checkpointed block keeps for backward: autograd's saved tensors and the outputs the policy
    caches (alive after the forward), without the parameters, the rotary table, the input, the output and the
    saved generator state (`tests.test_recompute.held_bytes`)."""
    exclude = {t.untyped_storage().data_ptr() for t in (x, freqs, *block.parameters())}
    return held_bytes(lambda: checkpoint(block, x, freqs, use_reentrant=False, context_fn=_titan_contexts),
                      exclude)[0]


def test_op_level_policy_of_a_torchtitan_block_matches_the_count():
    """Under torch's selective checkpointing with torchtitan's policy the block holds, per token, q, v, gate and
    down (the 1st, 3rd, 5th and 7th mm) and the attention kernel's output and log-sum-exp: what the planner
    counts for torchtitan, less the block input (here the checkpoint's own input, excluded above)."""
    h, heads, kv, ffn = 64, 4, 2, 96
    cfg = dataclasses.replace(get_preset("tiny"), hidden=h, n_heads=heads, n_kv_heads=kv, ffn=ffn)
    torch.manual_seed(0)
    block = _TitanBlock(h, heads, kv, ffn)
    d = h // heads
    freqs = torch.polar(torch.ones(256, d // 2), torch.rand(256, d // 2))
    held = {s: _held(block, torch.randn(1, s, h, requires_grad=True), freqs) for s in (64, 128)}
    per_token = (held[128] - held[64]) / 64
    fp32 = dataclasses.replace(TT, compute_dtype="fp32", residual_bytes=4)
    lay = Layout(recompute="selective")
    counted = layer_activation_bytes(cfg, 1, lay, fp32)["total"] - h * 4
    assert per_token == counted
