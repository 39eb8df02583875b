"""The GPU suite's plumbing, run at tiny sizes on the CPU (`--dry`): each step runs as its own process, its JSON
result is parsed into suite.json, and a failing step is recorded without stopping the suite."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module
    spec.loader.exec_module(module)
    return module


def test_dry_suite_runs_bench_moe_and_side_by_side(tmp_path: Path) -> None:
    suite = load_suite()
    assert suite.main([str(tmp_path), "--dry", "--only", "b,c"]) == 0
    report = json.loads((tmp_path / "suite.json").read_text())
    assert report["dry"] and report["device"] == "cpu"
    by_name = {s["name"]: s for s in report["steps"]}
    assert {s["group"] for s in report["steps"]} == {"b", "c"}
    for name, impl in (("bench moe", "grouped"), ("bench moe padded", "padded")):
        moe = by_name[name]["result"]
        assert moe["model"] == "tiny-moe" and moe["tokens_per_s"] > 0 and moe["micro_batch_size"] == 2
        assert moe["moe_impl"] == impl
    side = by_name["side by side"]["result"]
    assert side["fivefold_tokens_per_s"] > 0 and side["transformers_tokens_per_s"] > 0


def test_failing_step_is_recorded_and_the_suite_goes_on(tmp_path: Path) -> None:
    suite = load_suite()
    bad = suite.Step("bad", "x", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30)
    good = suite.Step("good", "x", [sys.executable, "-c", "print('{\"tokens_per_s\": 1.0, \"mfu\": null, "
                                    "\"step_time_s\": 0.5, \"peak_memory_allocated_bytes\": 0}')"], 30)
    for step in (bad, good):
        suite.run_step(step, {})
    assert bad.result["rc"] == 3 and bad.result["result"] is None and "boom" in bad.result["output_tail"]
    assert good.result["rc"] == 0 and good.result["result"]["tokens_per_s"] == 1.0
    assert "FAILED: boom" in suite.summary_line(bad.result)
    assert "1 tok/s" in suite.summary_line(good.result)


@pytest.mark.slow
def test_dry_float8_group_compares_float8_with_bf16(tmp_path: Path) -> None:
    """Group g at tiny size on the CPU (five processes, about a minute: slow): each recipe's bench, the two short
    training runs read from their metrics (checkpoints removed), and the comparison (speed-up over bf16, loss
    difference) in suite.json."""
    pytest.importorskip("torchao", reason="float8 needs torchao: pip install -e '.[test]'")
    suite = load_suite()
    assert suite.main([str(tmp_path), "--dry", "--only", "g"]) == 0
    report = json.loads((tmp_path / "suite.json").read_text())
    by_name = {s["name"]: s["result"] for s in report["steps"]}
    assert {f"bench float8 {r}" for r in ("off", "rowwise", "tensorwise")} <= by_name.keys()
    for recipe in ("off", "rowwise"):
        run = by_name[f"train float8 {recipe}"]
        assert run["steps"] == 3 and run["final_train_loss"] > 0 and run["val_loss"] > 0
        assert not (tmp_path / f"g-train-float8-{recipe}" / "checkpoints").exists()
    f8 = report["float8"]
    assert f8["rowwise_speedup"] > 0 and f8["tensorwise_speedup"] > 0
    want = by_name["train float8 rowwise"]["val_loss"] / by_name["train float8 off"]["val_loss"] - 1
    assert f8["val_loss_difference"] == pytest.approx(want, abs=1e-5)


def test_full_size_steps_cover_every_group() -> None:
    """Without --dry the suite times the full-size shapes, compiled, and covers groups a to g."""
    suite = load_suite()
    steps = suite.bench_steps(dry=False) + suite.only_rank_steps(False, Path("/tmp/x")) + [
        suite.side_by_side_step(False), suite.document_mask_step(False)] + suite.float8_steps(False, Path("/tmp/x"))
    assert {s.group for s in steps} == {"a", "b", "c", "d", "e", "f", "g"}
    float8 = [s for s in steps if s.group == "g"]
    assert all("--compile" in s.argv or "--train.compile" in s.argv for s in float8)
    assert [s.argv[s.argv.index("--train.float8") + 1] for s in float8] == ["off", "rowwise", "tensorwise", "off",
                                                                           "rowwise"]
    dense = [s for s in steps if s.group == "a"]
    assert sorted(int(s.argv[s.argv.index("--micro-batch") + 1]) for s in dense) == [2, 4, 8]
    assert all("--compile" in s.argv and "4096" in s.argv for s in dense)
    # the first and last rank of the pipelined example, rank 0 of the two whose ranks all hold the same
    assert len([s for s in steps if s.group == "d"]) == 4


@pytest.mark.slow
def test_dry_suite_runs_every_step(tmp_path: Path) -> None:
    suite = load_suite()
    rc = suite.main([str(tmp_path), "--dry", "--budget-s", "100000"])  # every step, however loaded the machine
    report = json.loads((tmp_path / "suite.json").read_text())
    failed = [(s["name"], s.get("output_tail", "")[-300:]) for s in report["steps"] if s.get("rc") != 0]
    assert rc == 0 and not failed, failed


def test_dry_suite_runs_the_document_mask_step(tmp_path: Path) -> None:
    suite = load_suite()
    assert suite.main([str(tmp_path), "--dry", "--only", "f"]) == 0
    (step,) = json.loads((tmp_path / "suite.json").read_text())["steps"]
    r = step["result"]
    assert r["document"]["attention_pairs"] < r["causal"]["attention_pairs"] == 4 * 128 * 129 // 2
    assert "attention pairs" in suite.summary_line(step)
