"""Model accounting shared by the trainer (metrics, pipeline stages) and the planner: parameters, FLOPs, and the
split of the blocks into pipeline stages balanced by those FLOPs.

One function per quantity, so that the FLOPs behind a logged MFU and a predicted MFU are the same.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal

from fivefold.config import ModelConfig


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, closed form. `lm_head` is 0 when tied to the embedding."""
    h, d = cfg.hidden, cfg.head_dim
    attn = h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + cfg.n_heads * d * h
    if cfg.is_moe:
        f = cfg.expert_ffn
        mlp = h * cfg.n_experts + (cfg.n_experts + cfg.n_shared_experts) * cfg.mlp_matrices * h * f
    else:
        mlp = cfg.mlp_matrices * h * cfg.ffn
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
        mlp = h * cfg.n_experts + (cfg.top_k + cfg.n_shared_experts) * cfg.mlp_matrices * h * f
    else:
        mlp = cfg.mlp_matrices * h * cfg.ffn
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


# ---------------------------------------------------------------------------------------------
# Pipeline stages balanced by compute (the engine's split and the planner's are this one function)


def head_cost_in_layers(cfg: ModelConfig, seq: int) -> float:
    """The output layer's (and the loss's) training FLOPs in units of one block's, to balance pipeline stages by
    compute. The embedding is a lookup, no matmul, so it weighs nothing here (as in `training_flops_per_token`)."""
    head = 6 * cfg.vocab_size * cfg.hidden
    return head / ((training_flops_per_token(cfg, seq) - head) / cfg.n_layers)


@lru_cache(maxsize=4096)
def _split_layers(n_layers: int, stages: int, last_extra: float) -> tuple[int, ...]:
    """Layers per pipeline stage, balanced by compute: the last stage also runs the output layer and the loss,
    worth `last_extra` blocks, so it gets fewer blocks; the remaining imbalance goes to the middle stages.
    Every stage keeps at least one block (when there are as many blocks as stages)."""
    if stages == 1:
        return (n_layers,)
    if stages >= n_layers:
        return (1,) * n_layers + (0,) * (stages - n_layers)
    extra = [0.0] * stages
    extra[-1] = last_extra
    lo, hi = 0.0, n_layers + last_extra + 1.0
    for _ in range(60):  # the lowest level at which the stages hold every layer
        mid = (lo + hi) / 2
        if sum(max(1, math.floor(mid - e)) for e in extra) >= n_layers:
            hi = mid
        else:
            lo = mid
    counts = [max(1, math.floor(hi - e)) for e in extra]
    order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), abs(s - (stages - 1) / 2)))
    i = 0
    while sum(counts) > n_layers:  # trim the overshoot from the middle stages first
        s = order[i % stages]
        if counts[s] > 1:
            counts[s] -= 1
        i += 1
    return tuple(counts)


def balanced_stage_layers(cfg: ModelConfig, n_stages: int, seq: int) -> list[int]:
    """Blocks per global pipeline stage, in model order, balanced by training FLOPs at sequence length `seq`:
    the last stage also runs the output layer and the loss (`head_cost_in_layers`)."""
    extra = round(head_cost_in_layers(cfg, seq), 6) if n_stages > 1 else 0.0  # rounded: a stable cache key
    return list(_split_layers(cfg.n_layers, n_stages, extra))
