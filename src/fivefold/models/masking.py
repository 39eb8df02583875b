"""Document masking and sliding windows for packed sequences (`model.attn_mask = "document"`,
`model.sliding_window`).

Packing rule. Prepared data put the end-of-document token (`eos_id` of the shard index) after every document,
and training windows of seq_len + 1 tokens are cut from the token stream regardless of documents. So a window
may begin or end inside a document: the part of a document in a window is trained as a document of its own
(positions restart at 0 at the window's first token; it never sees the part in the previous window).

The mask. `document_positions` gives each token its position inside its document (0 at each document's first
token; the EOS token belongs to the document it ends). A query token at sequence index i with document position
p sees key j iff i - p <= j <= i (same document, not in the future) and, with a sliding window of W tokens,
i - j < W (itself and the W - 1 tokens before it: the Mistral / transformers convention). Only the positions are
needed: the document of a token starts at its index minus its position, so the positions alone travel with the
tokens through every layout (pipeline stages, context-parallel chunks).

The loss convention (Megatron's eod_mask_loss): the prediction made from an EOS input token, whose target is
the next document's first token, is not trained (its target is -100, `mask_document_targets`).

Kernels. `DocumentMask` is built once per micro-batch (per pipeline stage) from the positions and shared by
every layer; it finds the documents of each row once (one host sync; none for a sliding window over plain
causal attention, whose rows are one document each). On every device the attention then runs
as variable-length attention: one causal `scaled_dot_product_attention` call per document (so the work is
sum(len^2)/2 instead of seq^2/2 and SDPA keeps its fused kernels; no dense [batch, 1, seq, seq] mask). A sliding
window cuts a document longer than the window into query tiles of W tokens, each against its 2W - 1 keys with
a banded [W, 2W - 1] mask. FlexAttention has no backward on CPU (PyTorch 2.11 to 2.13, eager or compiled), so
it cannot be the path that the tests train through.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def document_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position of each token of `tokens` [batch, seq] inside its document: 0 at the first token of the window and
    after every `eos_id`, counting up to and including the next `eos_id`."""
    b, s = tokens.shape
    index = torch.arange(s, device=tokens.device).expand(b, s)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    starts[:, 0] = True
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def mask_document_targets(inputs: torch.Tensor, targets: torch.Tensor, eos_id: int) -> torch.Tensor:
    """`targets` with -100 (not trained) where the input is `eos_id`: no prediction across a document boundary."""
    return targets.masked_fill(inputs == eos_id, -100)


class DocumentMask:
    """Which keys each query sees, for one micro-batch: `positions` [batch, seq] are the document positions of
    this module's tokens (see the module docstring), `window` the sliding window (None: none). Built once per
    forward and handed to every layer; the derived tables are computed on first use and kept (`documents` may be
    given when it is known without looking at the positions)."""

    def __init__(self, positions: torch.Tensor, window: int | None = None,
                 documents: list[list[tuple[int, int]]] | None = None) -> None:
        self.positions, self.window = positions, window
        # what the attention derives from the positions, once per batch: a layout's plan, the window's band masks
        self.cache: dict[tuple, object] = {}
        if documents is not None:
            self.documents = documents

    @functools.cached_property
    def documents(self) -> list[list[tuple[int, int]]]:
        """(start, stop) of each document of each row, in sequence index (one host sync)."""
        b, s = self.positions.shape
        rows = []
        for row in (self.positions == 0).cpu():
            starts = row.nonzero().squeeze(1).tolist()
            rows.append(list(zip(starts, starts[1:] + [s], strict=True)))
        return rows

    def band(self, q0: int, q1: int, k0: int, device: torch.device) -> torch.Tensor:
        """`band_mask` of a window tile, made once per batch for each shape (every interior tile and every layer
        share one)."""
        key = ("band", q1 - q0, q0 - k0)
        if key not in self.cache:
            self.cache[key] = band_mask(q0, q1, k0, self.window, device)
        return self.cache[key]


def window_tiles(start: int, stop: int, window: int) -> list[tuple[int, int, int]]:
    """(query start, query stop, key start) of the tiles that cover the document [start, stop) under a sliding
    window: query tiles of `window` tokens, each seeing keys from `window - 1` before its first query."""
    return [(q0, min(q0 + window, stop), max(start, q0 - window + 1)) for q0 in range(start, stop, window)]


def band_mask(q0: int, q1: int, k0: int, window: int, device: torch.device) -> torch.Tensor:
    """[q1 - q0, q1 - k0] booleans: key j visible to query i iff j <= i and i - j < window."""
    qi = torch.arange(q0, q1, device=device)[:, None]
    kj = torch.arange(k0, q1, device=device)[None, :]
    return (kj <= qi) & (qi - kj < window)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """Attention of q [batch, heads, seq, head_dim] against k, v [batch, kv_heads, seq, head_dim] within each
    document of `mask` (and its sliding window): one causal SDPA call per document, or per window tile."""
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for b, documents in enumerate(mask.documents):
        parts = []
        for start, stop in documents:
            if mask.window is None or stop - start <= mask.window:
                parts.append(F.scaled_dot_product_attention(q[b:b + 1, :, start:stop], k[b:b + 1, :, start:stop],
                                                            v[b:b + 1, :, start:stop], is_causal=True,
                                                            enable_gqa=gqa))
                continue
            for q0, q1, k0 in window_tiles(start, stop, mask.window):
                parts.append(F.scaled_dot_product_attention(
                    q[b:b + 1, :, q0:q1], k[b:b + 1, :, k0:q1], v[b:b + 1, :, k0:q1],
                    attn_mask=mask.band(q0, q1, k0, q.device), enable_gqa=gqa))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)
