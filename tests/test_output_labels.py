"""What the planner's outputs say about themselves: whether `plan --layout` and `plan scaling` predict compiled or
eager steps, that `--layout` refuses `--write-config` (which writes a search's best) instead of ignoring it, and
`plan validate --results --per-row` on a sweep's runs: every run, tokens/s per device, one sign convention."""

from __future__ import annotations

import json

from fivefold.cli import main
from fivefold.config import build_config
from fivefold.sweep.grid import config_json
from fivefold.sweep.store import Store

LAYOUT = ["--model", "llama-3.2-1b", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "4096",
          "--global-batch", "256K", "--layout", "dp=8,micro_batch_size=1,zero=1,recompute=none"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_layout_says_whether_it_predicts_compiled_or_eager(capsys):
    rc, eager, _ = run_cli(capsys, *LAYOUT)
    assert rc == 0 and "predicted eager, without torch.compile" in eager and "with torch.compile" not in eager
    rc, compiled, _ = run_cli(capsys, *LAYOUT, "--features", "compile")
    assert rc == 0 and "predicted with torch.compile (--features compile)" in compiled and "eager" not in compiled
    speeds = {}
    for flags in ([], ["--features", "compile"]):
        rc, out, _ = run_cli(capsys, *LAYOUT, *flags, "--json")
        data = json.loads(out)
        assert rc == 0 and data["compiled"] == bool(flags)
        speeds[bool(flags)] = data["tokens_per_s_per_device"]
    assert speeds[True] > speeds[False]  # the label is the model the figures come from


def test_plan_layout_refuses_write_config(capsys, tmp_path):
    target = tmp_path / "best.toml"
    rc, out, err = run_cli(capsys, *LAYOUT, "--write-config", str(target))
    assert rc == 2 and "--write-config writes the best layout of a search" in err and "--fix" in err
    assert not target.exists() and out == ""


def test_plan_scaling_says_whether_it_predicts_compiled_or_eager(capsys):
    base = ["scaling", "--model", "llama-3.2-1b", "--gpu", "h100", "--gpus-per-node", "4", "--nodes", "1,2",
            "--weak", "--seq-len", "4096", "--global-batch", "256K"]
    rc, eager, _ = run_cli(capsys, *base)
    assert rc == 0 and eager.splitlines()[0].startswith("predicted eager, without torch.compile")
    rc, compiled, _ = run_cli(capsys, *base, "--features", "compile")
    assert rc == 0 and compiled.splitlines()[0] == "predicted with torch.compile (--features compile)"
    tokens = {}
    for flags in ([], ["--features", "compile"]):  # --json says it too, and its figures follow
        rc, out, _ = run_cli(capsys, *base, *flags, "--json")
        data = json.loads(out)
        assert rc == 0 and data["compiled"] == bool(flags)
        tokens[bool(flags)] = data["points"][0]["tokens_per_s_per_gpu"]
    assert tokens[True] > tokens[False]


def _store(path, measured_tok_s: float) -> None:
    """A sweep's store of two CPU runs of the tiny model: dp2 finished at `measured_tok_s` per device, tp2 ran out
    of memory."""
    with Store(path) as store:
        for key, layout, status in (("dp2", {"dp": 2}, "ok"), ("tp2", {"tp": 2}, "oom")):
            cfg = build_config(None, {"model.preset": "tiny", "train.seq_len": "128", "train.global_batch_size": "16",
                                      "train.device": "cpu", "train.dtype": "fp32", "layout.micro_batch_size": "8",
                                      **{f"layout.{k}": str(v) for k, v in layout.items()}})
            row = {"key": key, "sweep": "t", "label": key, "model": "tiny", "status": status, "n_devices": 2,
                   "nodes": 1, "config": config_json(cfg), "device": "cpu"}
            if status == "ok":
                row.update(step_time_s=16 * 128 / (2 * measured_tok_s), tokens_per_s=2 * measured_tok_s,
                           tokens_per_s_per_device=measured_tok_s, peak_memory_bytes=2**28)
            store.record(row)


def test_validate_results_per_row_one_sign_per_device(capsys, tmp_path):
    results = tmp_path / "sweep.db"
    _store(results, 1000.0)
    rc, out, _ = run_cli(capsys, "validate", "--results", str(results), "--json")
    assert rc == 0 and "rows" not in json.loads(out)  # only with --per-row
    rc, out, _ = run_cli(capsys, "validate", "--results", str(results), "--per-row", "--json")
    rows = {r["layout"].split()[0] + r["layout"].split()[1]: r for r in json.loads(out)["rows"]}
    assert rc == 0 and len(rows) == 2
    ok = rows["dp2tp1"]
    assert ok["ran"] and ok["measured_tok_s_gpu"] == 1000.0 and ok["held_out"] is None
    assert not rows["dp1tp2"]["ran"]
    predicted = ok["predicted_tok_s_gpu"]
    assert predicted > 1000.0  # the tiny model on the cpu profile: far faster than the 1,000 tokens/s stored
    rc, text, _ = run_cli(capsys, "validate", "--results", str(results), "--per-row")
    assert rc == 0
    table = text[text.index("every row"):].splitlines()
    # one convention, stated: predicted / measured step time - 1, so a faster prediction is negative
    assert "predicted / measured - 1: - = predicted faster than measured" in table[0]
    assert "tok/s/device pred" in table[1] and "GPU" not in text
    line = next(x for x in table if x.split()[1:3] == ["1", "dp2"])
    assert f"{100 * (1000.0 / predicted - 1):+.0f} %" in line and line.split()[-7] == "-"  # split: nothing fitted


def test_only_rank_summary_states_its_sign():
    """--only-rank's differences are measured / planner - 1, as its header says: a rank that held 10 % more than
    predicted shows +10.0 %, one that computed 20 % less -20.0 %."""
    import io

    from fivefold.tools.only_rank import print_summary

    mib = 2**20
    memory = {part: {"measured": m * mib, "predicted": 100 * mib}
              for part, m in (("parameters", 100), ("gradients", 100), ("optimizer", 100),
                              ("activations_and_buffers", 110), ("peak", 110))}
    summary = {"rank": 0, "device": "cpu", "peak_memory_bytes": {"resident": 110 * mib}, "memory_bytes": memory,
               "coordinates": {"planner_rank": "first", "planner_rank_exact": True, "world_size": 2},
               "compute_s": {"measured": 0.8, "predicted": 1.0}, "planner": {"hardware": "cpu"}}
    out = io.StringIO()
    print_summary(summary, out)
    lines = out.getvalue().splitlines()
    assert lines[1].rstrip().endswith("difference  (measured / planner - 1)")
    assert lines[-2].split()[-2:] == ["+10.0", "%"] and lines[-1].split()[-2:] == ["-20.0", "%"]
