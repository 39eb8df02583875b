"""The attention that a document mask and a sliding window execute (`fivefold.flops.attention_pairs`): the (q, k)
pairs counted one by one over packed sequences, against the closed forms and the histogram's expectation."""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction

import numpy as np
import pytest

from fivefold.flops import (
    DocumentLengths,
    attention_fraction,
    attention_pairs,
    causal_pairs,
    training_flops_per_token,
)
from fivefold.presets import get_preset


def pairs_in(document_ids: np.ndarray, window: int | None) -> int:
    """Pairs (q, k) of one sequence with k <= q in the same document and q - k < window (None: no window), counted
    from the whole mask."""
    s = len(document_ids)
    q, k = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    allowed = (k <= q) & (document_ids[:, None] == document_ids[None, :])
    if window is not None:
        allowed &= q - k < window
    return int(allowed.sum())


def stream_ids(lengths: list[int], repeats: int) -> np.ndarray:
    """Each token's document number in the stream of `lengths` repeated `repeats` times."""
    return np.repeat(np.arange(len(lengths) * repeats), lengths * repeats)


@pytest.mark.parametrize("seq,window", [(1, None), (7, None), (64, None), (64, 1), (64, 16), (64, 63), (64, 64),
                                        (64, 100), (33, 5)])
def test_window_pairs_closed_form_and_mask(seq, window):
    m = seq if window is None else min(seq, window)
    closed = sum(seq - j for j in range(m))  # query q sees min(q + 1, window) keys
    assert attention_pairs(seq, window) == closed == pairs_in(np.zeros(seq, dtype=int), window)
    if window is None or window >= seq:
        assert closed == causal_pairs(seq)


def test_documents_of_one_length_cut_as_the_dataset_cuts_windows():
    # documents of L tokens, windows every `seq` tokens: with gcd(L, seq) = 1 the first L windows start at every
    # offset into a document once, so their mean is the expectation exactly
    for length, seq, window in ((5, 16, None), (37, 64, None), (37, 64, 8), (99, 64, None), (3, 8, 2), (301, 128, 32)):
        ids = stream_ids([length], seq + 2)
        counts = [pairs_in(ids[i * seq:(i + 1) * seq], window) for i in range(length)]
        assert Fraction(sum(counts), length) == attention_pairs(seq, window, DocumentLengths.of([length]))


@pytest.mark.parametrize("seed", range(4))
def test_mixed_documents_every_start_offset(seed):
    # a stream repeating one pack of mixed documents: a sequence starting at each offset of one period is the
    # uniformly placed start the expectation assumes, so the mean over the offsets is it exactly whenever
    # min(seq, window) is a power of two (no bin straddles it), and close otherwise (the two-point bin)
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 3, 5, 8, 13, 30, 64, 90, 200]) for _ in range(rng.randint(2, 9))]
    period = sum(lengths)
    ids = stream_ids(lengths, 2 + 256 // period)
    docs = DocumentLengths.of(lengths)
    for seq, window, exact in ((32, None, True), (64, None, True), (64, 16, True), (128, 32, True), (48, None, False),
                               (64, 24, False)):
        brute = Fraction(sum(pairs_in(ids[s:s + seq], window) for s in range(period)), period)
        priced = attention_pairs(seq, window, docs)
        if exact:
            assert priced == brute, (lengths, seq, window)
        else:
            assert float(priced) == pytest.approx(float(brute), rel=0.01), (lengths, seq, window)
        assert priced <= attention_pairs(seq, window)  # never more than without documents


def test_histogram_merges_and_prices_like_its_lengths():
    lengths = [1, 2, 3, 4, 7, 8, 100, 1000, 4096, 5000]
    merged = DocumentLengths.of(lengths[:4]).merged(DocumentLengths.of(lengths[4:]))
    assert merged == DocumentLengths.of(lengths)
    assert merged.documents == 10 and merged.tokens == sum(lengths)
    assert [b.start for b in merged.bins] == [1, 2, 4, 8, 64, 512, 4096]


def test_model_mask_scales_only_the_attention_term():
    cfg = get_preset("llama-3.2-1b")
    seq, doc = 8192, 1024
    docs = DocumentLengths.of([doc])
    causal = training_flops_per_token(cfg, seq)
    attention = 6 * cfg.n_layers * seq * cfg.n_heads * cfg.head_dim
    masked = dataclasses.replace(cfg, attn_mask="document")
    fraction = attention_fraction(masked, seq, docs)
    # documents of 1024 in windows of 8192: about seq (doc + 1) / 2 pairs of seq (seq + 1) / 2, less the cut ones
    assert fraction == pytest.approx(float(attention_pairs(seq, None, docs)) / (seq * (seq + 1) / 2))
    assert 0.1 < fraction < (doc + 1) / (seq + 1)
    assert training_flops_per_token(masked, seq, docs=docs) == pytest.approx(causal - attention * (1 - fraction))
    assert training_flops_per_token(masked, seq) == causal  # no lengths: priced as causal
    windowed = dataclasses.replace(cfg, sliding_window=2048)
    band = sum(seq - j for j in range(2048)) / (seq * (seq + 1) / 2)
    assert training_flops_per_token(windowed, seq) == pytest.approx(causal - attention * (1 - band))
    assert training_flops_per_token(masked, seq, "full", docs) == training_flops_per_token(cfg, seq, "full")
