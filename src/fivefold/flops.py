"""Model accounting shared by the trainer (metrics, pipeline stages) and the planner: parameters, FLOPs, and the
split of the blocks into pipeline stages balanced by those FLOPs.

One function per quantity, so that the FLOPs behind a logged MFU and a predicted MFU are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Literal

from fivefold.config import ModelConfig


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, closed form. `lm_head` is 0 when tied to the embedding."""
    h, d = cfg.hidden, cfg.head_dim
    attn = h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + cfg.n_heads * d * h
    attn += (cfg.n_heads + 2 * cfg.n_kv_heads) * d if cfg.qkv_bias else 0
    if cfg.is_moe:
        f = cfg.expert_ffn
        mlp = h * cfg.n_experts + (cfg.n_experts + cfg.n_shared_experts) * cfg.mlp_matrices * h * f
        mlp += h if cfg.shared_expert_gate else 0
    else:
        mlp = cfg.mlp_matrices * h * cfg.ffn
    return {
        "embedding": cfg.vocab_size * h,
        "attention": cfg.n_layers * attn,
        "mlp": cfg.n_layers * mlp,
        "norms": cfg.n_layers * (2 * h + qk_norm_params(cfg)) + h,
        "lm_head": 0 if cfg.tied_embeddings else cfg.vocab_size * h,
    }


def qk_norm_params(cfg: ModelConfig) -> int:
    """The query and key norms' weights of one layer (`model.qk_norm`)."""
    if cfg.qk_norm == "head":
        return 2 * cfg.head_dim
    return (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim if cfg.qk_norm == "full" else 0


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


# ---------------------------------------------------------------------------------------------
# Attention actually executed: (query, key) pairs under the causal, document and sliding-window masks


@dataclass(frozen=True)
class LengthBin:
    """Documents whose length (tokens, each with its end-of-document token) lies in [start, 2 * start): how many,
    and the sums of their lengths, squared lengths and cubed lengths (the moments that price attention exactly)."""

    start: int
    documents: int
    tokens: int
    tokens_squared: int
    tokens_cubed: int


@dataclass(frozen=True)
class DocumentLengths:
    """The distribution of document lengths in power-of-two bins (bin k holds lengths 2^k .. 2^(k+1) - 1), as
    `fivefold data prepare` records it per split; `attention_pairs` prices attention from it."""

    bins: tuple[LengthBin, ...]

    @classmethod
    def of(cls, lengths: Iterable[int]) -> DocumentLengths:
        """The bins of these lengths (each >= 1)."""
        sums: dict[int, list[int]] = {}
        for n in lengths:
            n = int(n)
            if n < 1:
                raise ValueError(f"a document length must be >= 1, got {n}")
            acc = sums.setdefault(1 << (n.bit_length() - 1), [0, 0, 0, 0])
            acc[0] += 1
            acc[1] += n
            acc[2] += n * n
            acc[3] += n * n * n
        return cls(tuple(LengthBin(start, *acc) for start, acc in sorted(sums.items())))

    def merged(self, other: DocumentLengths) -> DocumentLengths:
        sums: dict[int, list[int]] = {}
        for b in (*self.bins, *other.bins):
            acc = sums.setdefault(b.start, [0, 0, 0, 0])
            for i, v in enumerate((b.documents, b.tokens, b.tokens_squared, b.tokens_cubed)):
                acc[i] += v
        return DocumentLengths(tuple(LengthBin(start, *acc) for start, acc in sorted(sums.items())))

    @property
    def documents(self) -> int:
        return sum(b.documents for b in self.bins)

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.bins)

    @property
    def mean(self) -> float:
        return self.tokens / self.documents if self.documents else 0.0


@lru_cache(maxsize=256)
def attention_pairs(seq: int, window: int | None = None, docs: DocumentLengths | None = None) -> Fraction:
    """The (query, key) pairs that causal attention over a packed sequence of `seq` tokens executes, expected over
    where the sequence starts in the stream of documents: pairs with 0 <= q - k < `window` (None: no window) inside
    one document, a document cut by the sequence's start counting from there (`docs` None: one document longer
    than any sequence, i.e. plain causal attention, seq (seq + 1) / 2 pairs without a window).

    A query at offset a >= 0 into its document at position q of the sequence sees min(a, q, window - 1) + 1 keys.
    With the sequence's start uniformly placed in the stream, P(a >= j) = sum over documents of max(L - j, 0)
    divided by the tokens, so with m = min(seq, window) the expected pairs are sum_{j < m} (seq - j) P(a >= j) =
    sum over documents of g(L) / tokens, with g(L) = sum_{j < min(L, m)} (seq - j)(L - j): the cubic
    (-L^3 + 3 seq L^2 + (3 seq + 1) L) / 6 for L <= m and linear in L for L >= m. Each power-of-two bin lies on
    one side of m whenever m is a power of two, and its moments then give its sum of g exactly; otherwise the one
    bin holding m is taken as two lengths, its mean plus and minus its standard deviation, half its documents
    each (its first two moments kept)."""
    m = seq if window is None else min(seq, window)
    a1 = m * seq - m * (m - 1) // 2  # sum_{j < m} (seq - j): the pairs of a document longer than the sequence
    a2 = seq * m * (m - 1) // 2 - (m - 1) * m * (2 * m - 1) // 6  # sum_{j < m} j (seq - j)
    if docs is None or docs.tokens == 0:  # no documents known: one longer than the sequence
        return Fraction(a1)
    total = Fraction(0)
    for b in docs.bins:
        if 2 * b.start - 1 <= m:  # every length <= m: the cubic
            total += Fraction(-b.tokens_cubed + 3 * seq * b.tokens_squared + (3 * seq + 1) * b.tokens, 6)
        elif b.start >= m:  # every length >= m: linear
            total += a1 * b.tokens - a2 * b.documents
        else:  # the bin holding m: two lengths with the bin's mean and variance
            mean = b.tokens / b.documents
            std = math.sqrt(max(b.tokens_squared / b.documents - mean * mean, 0.0))
            for x in (mean - std, mean + std):
                g = (-x ** 3 + 3 * seq * x * x + (3 * seq + 1) * x) / 6 if x <= m else a1 * x - a2
                total += Fraction(g * b.documents / 2)
    return total / docs.tokens


def causal_pairs(seq: int) -> int:
    """The pairs of plain causal attention over `seq` tokens (the diagonal included)."""
    return seq * (seq + 1) // 2


def causal_equivalent(cfg: ModelConfig) -> ModelConfig:
    """The model with plain causal attention: what the causal-equivalent MFU counts."""
    return dataclasses.replace(cfg, attn_mask="causal", sliding_window=None) if cfg.masks_attention else cfg


def attention_fraction(cfg: ModelConfig, seq: int, docs: DocumentLengths | None = None) -> float:
    """The share of causal attention's (query, key) pairs that the model's mask executes per sequence of `seq`
    tokens: 1 for plain causal attention; under document masking, from the documents' lengths `docs` (None: as
    causal, documents at least as long as the sequence); under a sliding window, its band."""
    if not cfg.masks_attention:
        return 1.0
    docs = docs if cfg.attn_mask == "document" else None
    return float(attention_pairs(seq, cfg.sliding_window, docs) / causal_pairs(seq))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, docs: DocumentLengths | None = None) -> float:
    """Training FLOPs of the attention scores and the weighted sum per token, as executed: causal attention's
    6 * layers * seq * n_heads * head_dim (half of the full 12 L s H d, what flash kernels compute) times
    `attention_fraction` under a document mask or a sliding window."""
    causal = 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return causal if not cfg.masks_attention else causal * attention_fraction(cfg, seq_len, docs)


def training_flops_per_token(
    cfg: ModelConfig, seq_len: int, attention: Literal["causal", "full"] = "causal",
    docs: DocumentLengths | None = None,
) -> float:
    """Model FLOPs of one token's forward and backward pass (no recomputation: this is MFU, not HFU).

    6 * (active matmul parameters) for the projections, plus the attention scores and the weighted sum:
    forward 2 * 2 * seq * n_heads * head_dim per layer and token, times 3 for forward + backward, i.e.
    12 * layers * seq * n_heads * head_dim. With `attention="causal"` (the default) the attention the model's
    mask executes is counted (`attention_flops_per_token`): half of that term for causal attention (the masked
    half of the score matrix is skipped, as flash kernels do), less under a document mask (`docs`: the documents'
    lengths) or a sliding window. `"full"` counts the whole score matrix, whatever the mask, as the playbook's
    `6N + 12 L h s` does (the playbook's N also counts the input embedding, which is a lookup, not a matmul; this
    function leaves it out).
    """
    if attention == "full":
        return 6 * active_matmul_params(cfg) + 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6 * active_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, docs)


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
