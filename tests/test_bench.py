"""`fivefold bench` smoke test on CPU."""

from __future__ import annotations

import json

from fivefold.cli import main
from fivefold.flops import training_flops_per_token
from fivefold.presets import get_preset


def test_bench_cpu_json(capsys, tmp_path):
    out = tmp_path / "bench.json"
    out.write_text("my notes\n")  # a file already there is kept as bench.json.bak, not overwritten
    assert main(["bench", "--model", "tiny", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2",
                 "--steps", "2", "--warmup", "1", "--json", "--log.peak_tflops", "0.5", "--out", str(out)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (tmp_path / "bench.json.bak").read_text() == "my notes\n" and json.loads(out.read_text()) == r
    tokens_per_step = 2 * 2 * 64
    assert r["tokens_per_s"] == r["tokens_per_s_per_device"]
    assert abs(r["tokens_per_s"] * r["step_time_s"] - tokens_per_step) < 1e-6 * tokens_per_step
    flops = training_flops_per_token(get_preset("tiny"), 64)
    assert abs(r["tflops_per_device"] - r["tokens_per_s"] * flops / 1e12) < 1e-9
    assert abs(r["mfu"] - r["tflops_per_device"] / 0.5) < 1e-9
    assert set(r["time_split_s"]) == {"forward", "backward", "optimizer"}
    assert all(v > 0 for v in r["time_split_s"].values())
