"""The one FLOPs function against the playbook's published accounting."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fivefold.flops import active_matmul_params, count_params, training_flops_per_token
from fivefold.presets import get_preset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "playbook_benchmark_runs.csv"


def test_full_attention_matches_playbook_formula():
    # playbook A2: 6N + 12 L h s per token, where N counts input embedding and LM head separately
    cfg = get_preset("playbook-8b")
    s = 4096
    n_untied = count_params(cfg) - cfg.n_layers * 2 * cfg.hidden - cfg.hidden  # norms are not in the formula
    playbook = 6 * n_untied + 12 * cfg.n_layers * cfg.hidden * s
    ours = training_flops_per_token(cfg, s, attention="full")
    assert ours == playbook - 6 * cfg.vocab_size * cfg.hidden  # the embedding lookup is not a matmul


def test_causal_halves_attention_term_only():
    cfg = get_preset("llama-3.1-8b")
    full, causal = (training_flops_per_token(cfg, 8192, attention=a) for a in ("full", "causal"))
    assert full - causal == 6 * cfg.n_layers * 8192 * cfg.hidden


def test_moe_counts_active_experts_only():
    cfg = get_preset("mixtral-mini")
    h, f = cfg.hidden, cfg.expert_ffn
    dense_part = active_matmul_params(cfg) - cfg.n_layers * (h * cfg.n_experts + cfg.top_k * 3 * h * f)
    assert dense_part == cfg.n_layers * (2 * h * h + 2 * h * cfg.n_kv_heads * cfg.head_dim) + cfg.vocab_size * h


@pytest.mark.skipif(not SHARED.is_file(), reason="shared playbook data not beside the repo")
def test_reproduces_published_recomputed_mfu():
    """tok/s/GPU x FLOPs/token / 989.5e12 reproduces the data's recomputed MFU column (8B rows)."""
    cfg = get_preset("playbook-8b")
    per_token = training_flops_per_token(cfg, 4096, attention="full") + 6 * cfg.vocab_size * cfg.hidden
    checked = 0
    with open(SHARED) as f:
        for row in csv.DictReader(f):
            if row["model"] == "8B" and row["status"] == "ok":
                mfu = float(row["tok_s_gpu"]) * per_token / 989.5e12 * 100
                assert mfu == pytest.approx(float(row["mfu_recomputed_pct"]), abs=0.01)
                checked += 1
    assert checked > 50
