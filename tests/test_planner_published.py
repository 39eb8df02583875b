"""`fivefold plan validate --data FILE` on other engines' published runs: the torchtitan Llama 3.1 rows shipped in
`planner/published/`, each modelled with its own framework (`framework` column), split (`split` column) and features
(`features`: compile, float8, async TP, inputs of the compute model, `planner/features.py`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from fivefold.cli import main
from fivefold.planner import profile

PLANNER = Path(profile.__file__).parent
ROWS = PLANNER / "published" / "torchtitan-llama3.1-h100.csv"
TORCHTITAN = PLANNER / "profiles" / "torchtitan-h100-96gb.toml"


def published() -> list[dict[str, str]]:
    with ROWS.open() as f:
        return list(csv.DictReader(f))


def test_published_rows_are_the_llama31_shapes():
    """The shapes are Llama 3.1's (Meta's model cards: 8.03 B, 70.6 B and 405.9 B parameters, untied) and each
    row's layout covers its GPUs exactly."""
    from fivefold.config import ModelConfig

    expected = {"llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9, "llama3.1-405b": 405.9e9}
    for r in published():
        cfg = ModelConfig(name=r["model"], n_layers=int(r["n_layers"]), hidden=int(r["hidden"]),
                          n_heads=int(r["heads"]), n_kv_heads=int(r["kv_heads"]), ffn=int(r["ffn"]),
                          vocab_size=int(r["vocab"]), tied_embeddings=False)
        h, d = cfg.hidden, cfg.hidden // cfg.n_heads
        block = 2 * h * h + 2 * h * cfg.n_kv_heads * d + 3 * h * cfg.ffn + 2 * h
        n = cfg.n_layers * block + 2 * cfg.vocab_size * h + h
        assert abs(n / expected[r["model"]] - 1) < 0.005, (r["model"], n)
        degrees = [int(r[k]) for k in ("dp", "tp", "pp", "cp", "ep")]
        assert degrees[0] * degrees[1] * degrees[2] * degrees[3] == int(r["gpus"]) == 8 * int(r["nodes"]), r


def test_validate_models_each_row_with_its_framework_and_features(capsys):
    rows = published()
    rc = main(["plan", "validate", "--data", str(ROWS), "--profile", str(TORCHTITAN), "--json", "--per-row"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    plain = [r for r in rows if not r["features"]]
    features = [f for r in rows for f in r["features"].split("+") if f]
    assert out["features"] == {"rows": len(rows) - len(plain), **{f: features.count(f) for f in set(features)}}
    fit = [r for r in rows if r["split"] == "fit"]
    assert len(fit) == 1 and not fit[0]["features"]  # the one row matmul_efficiency is fitted on
    assert out["held_out"]["rows"] == len(rows) - 1 and out["fitted"]["rows"] == 1
    assert [(r["model"], r["nodes"], r["measured_tok_s_gpu"]) for r in out["rows"]] == [
        (r["model"], int(r["nodes"]), float(r["tok_s_gpu"])) for r in rows]
    for r, source in zip(out["rows"], rows, strict=True):
        assert r["held_out"] == (source["split"] == "held-out") and r["ran"]
        assert r["predicted_tok_s_gpu"] > 0 and r["predicted_memory_gib"] > 0
    rc = main(["plan", "validate", "--data", str(ROWS), "--profile", str(TORCHTITAN), "--per-row"])
    text = capsys.readouterr().out
    assert rc == 0 and f"{len(rows) - len(plain)} row(s) modelled with their features" in text
    assert "torch.compile" in text
    assert text.count("llama3.1-8b ") == sum(r["model"] == "llama3.1-8b" for r in rows)  # one line per row


def test_validate_names_an_unknown_framework_feature_or_split(tmp_path, capsys):
    rows = published()
    for column, value, said in (("framework", "titan", "known frameworks:"), ("features", "fp4", "known features:"),
                                ("split", "test", "use 'fit' or 'held-out'")):
        bad = tmp_path / f"{column}.csv"
        with bad.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerow({**rows[0], column: value})
        assert main(["plan", "validate", "--data", str(bad), "--profile", str(TORCHTITAN)]) == 2
        err = capsys.readouterr().err
        assert repr(value) in err and said in err, err
