"""The memory conventions of torchtitan's framework profile (`planner/frameworks/torchtitan.toml`) against closed
forms of what its code allocates: the whole-batch loss as the caching allocator reserves it, and the tensors its
op-level selective recompute keeps (eager, and under torch.compile)."""

from __future__ import annotations

import dataclasses

import pytest

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
