"""Model accounting shared by the trainer (metrics) and the planner: parameters and FLOPs.

One function per quantity, so that the FLOPs behind a logged MFU and a predicted MFU are the same.
"""

from __future__ import annotations

from typing import Literal

from fivefold.config import ModelConfig


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, closed form. `lm_head` is 0 when tied to the embedding."""
    h, d = cfg.hidden, cfg.head_dim
    attn = h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + cfg.n_heads * d * h
    if cfg.is_moe:
        f = cfg.expert_ffn
        mlp = h * cfg.n_experts + cfg.n_experts * 3 * h * f + cfg.n_shared_experts * 3 * h * f
    else:
        mlp = 3 * h * cfg.ffn
    return {
        "embedding": cfg.vocab_size * h,
        "attention": cfg.n_layers * attn,
        "mlp": cfg.n_layers * mlp,
        "norms": cfg.n_layers * 2 * h + h,
        "lm_head": 0 if cfg.tied_embeddings else cfg.vocab_size * h,
    }


def count_params(cfg: ModelConfig) -> int:
    """Total parameters (each tied weight counted once), as `sum(p.numel())` reports."""
    return sum(param_breakdown(cfg).values())


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for each token: all projections, the routed top-k and shared
    experts and the router for MoE, and the output layer (a matmul even when tied). The embedding lookup
    and the norms are not matmuls and are not counted."""
    h, d = cfg.hidden, cfg.head_dim
    attn = h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + cfg.n_heads * d * h
    if cfg.is_moe:
        f = cfg.expert_ffn
        mlp = h * cfg.n_experts + (cfg.top_k + cfg.n_shared_experts) * 3 * h * f
    else:
        mlp = 3 * h * cfg.ffn
    return cfg.n_layers * (attn + mlp) + cfg.vocab_size * h


def training_flops_per_token(
    cfg: ModelConfig, seq_len: int, attention: Literal["causal", "full"] = "causal"
) -> float:
    """Model FLOPs of one token's forward and backward pass (no recomputation: this is MFU, not HFU).

    6 * (active matmul parameters) for the projections, plus the attention scores and the weighted sum:
    forward 2 * 2 * seq * n_heads * head_dim per layer and token, times 3 for forward + backward, i.e.
    12 * layers * seq * n_heads * head_dim. With `attention="causal"` (the default, what flash kernels
    compute) that term is halved because the masked half of the score matrix is skipped; `"full"` counts
    the whole score matrix, as the playbook's `6N + 12 L h s` does (the playbook's N also counts the
    input embedding, which is a lookup, not a matmul; this function leaves it out).
    """
    attn = 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    if attention == "causal":
        attn //= 2
    return 6 * active_matmul_params(cfg) + attn
