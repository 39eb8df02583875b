"""A CPU profile's `heap_retention` (what glibc keeps of freed memory, per live byte): the planner's peak is the
live tensors times it, with the difference as its own part (`allocator_cache`); the search's fit check and the
estimate agree; a run checked against its plan does not count the cache twice."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import build_config
from fivefold.planner.hardware import get_cluster
from fivefold.planner.memory import with_heap_retention
from fivefold.planner.predict import engine_parts, estimate_run, predict_run, run_framework
from fivefold.planner.search import _fits, estimate
from fivefold.train.expect import CPU_HEAP_MARGIN_BYTES, CPU_HEAP_RATIO, Expectation, Interval, PlanCheck

GIB = 2**30


def _cfg(**layout: str):
    return build_config(None, {"model.preset": "tiny", "train.seq_len": "128", "train.global_batch_size": "16",
                               "train.device": "cpu", "train.dtype": "fp32",
                               **{f"layout.{k}": v for k, v in layout.items()}})


@pytest.mark.parametrize("layout", [{"micro_batch_size": "4"}, {"micro_batch_size": "16", "recompute": "full"},
                                    {"tp": "2", "sp": "true", "micro_batch_size": "8"},
                                    {"pp": "2", "micro_batch_size": "4"}])
def test_the_peak_is_the_live_tensors_times_the_retention(layout):
    cfg = _cfg(**layout)
    plain = get_cluster("cpu")
    kept = dataclasses.replace(plain, heap_retention=1.75)
    a, b = predict_run(cfg, plain, "cpu"), predict_run(cfg, kept, "cpu")
    assert "allocator_cache" not in a["memory_bytes"]
    live = sum(a["memory_bytes"].values())
    assert live == pytest.approx(a["peak_memory_bytes"])
    assert b["peak_memory_bytes"] == pytest.approx(1.75 * a["peak_memory_bytes"])
    assert b["memory_bytes"]["allocator_cache"] == pytest.approx(0.75 * live)
    assert {k: v for k, v in b["memory_bytes"].items() if k != "allocator_cache"} == a["memory_bytes"]
    assert b["step_time_s"] == a["step_time_s"]  # memory only


def test_applying_the_retention_twice_is_applying_it_once_and_1_changes_nothing():
    mem = {"first": {"parameters": 4.0, "activations": 12.0}, "last": {"parameters": 4.0, "activations": 4.0}}
    once = with_heap_retention(mem, 1.5)
    assert once == {"first": {"parameters": 4.0, "activations": 12.0, "allocator_cache": 8.0},
                    "last": {"parameters": 4.0, "activations": 4.0, "allocator_cache": 4.0}}
    assert with_heap_retention(once, 1.5) == once
    assert with_heap_retention(mem, 1.0) is mem


def test_the_fit_check_and_the_estimate_agree_on_the_retained_peak():
    """A device whose memory lies between the live peak and the retained one: fits without the retention, not with
    it, in the search's fit check and in the estimate alike."""
    cfg = _cfg(micro_batch_size="16")
    lay = estimate_run(cfg, get_cluster("cpu"), "cpu").layout
    fw = run_framework(cfg, "cpu")
    live = estimate_run(cfg, get_cluster("cpu"), "cpu").peak_bytes
    between = (1.5 * live) / fw.usable_memory_fraction / GIB  # usable memory = 1.5 x the live peak
    for retention, fits in ((1.0, True), (1.4, True), (1.6, False)):
        hw = dataclasses.replace(get_cluster("cpu"), memory_gib=between, heap_retention=retention)
        ok, peak, _ = _fits(cfg.model, cfg.train.seq_len, lay, fw, hw, 1.0)
        e = estimate(cfg.model, cfg.train.seq_len, lay, fw, hw)
        assert ok is fits and e.fits is fits, retention
        assert peak == pytest.approx(retention * live) and e.peak_bytes == pytest.approx(retention * live)


def test_engine_parts_keep_the_cache_apart_only_where_there_is_one():
    parts = {"parameters": 1.0, "gradients": 1.0, "optimizer": 2.0, "activations": 3.0, "transient": 1.0,
             "comm_buffers": 0.5}
    assert "allocator_cache" not in engine_parts(parts)
    grouped = engine_parts({**parts, "allocator_cache": 4.25})
    assert grouped["allocator_cache"] == 4.25 and grouped["buffers"] == 0.5 and grouped["activations"] == 4.0


def test_a_run_checked_against_its_plan_does_not_count_the_cache_twice():
    """The CPU's allowance (`CPU_HEAP_RATIO` x the prediction + a margin) is for the allocator's cache; with a
    prediction that already holds its own estimate of that cache, the allowance is on the live part alone."""
    live, cache = 0.2 * GIB, 0.2 * GIB
    e = Expectation("cpu-calibrated", 1.0, live + cache, {"parameters": 0.05 * GIB, "gradients": 0.05 * GIB,
                                                         "optimizer": 0.1 * GIB, "activations": 0.0,
                                                         "buffers": 0.0, "allocator_cache": cache})
    limit = CPU_HEAP_RATIO * live + CPU_HEAP_MARGIN_BYTES

    def said(peak: float) -> list[str]:
        check = PlanCheck(e, "cpu", held_states=0)
        lines: list[str] = []
        for _ in range(2):  # the first interval is not judged
            lines = check.observe(Interval(10, [10.0] * 2, [0.0] * 2, [int(peak + GIB)] * 2, [GIB] * 2))
        return lines

    assert said(0.98 * limit) == []
    # above the live allowance, though below what it would be on the whole prediction (which counts the cache)
    assert 1.02 * limit < CPU_HEAP_RATIO * (live + cache) + CPU_HEAP_MARGIN_BYTES
    lines = said(1.02 * limit)
    assert len(lines) == 1 and "peak memory" in lines[0]
