"""The layout search judged in a pool of processes (`planner.search.search_workers`) returns what the search in
one process returns: the same candidates in the same order with the same figures, the same rejections and the
same closest misfit."""

from __future__ import annotations

import dataclasses
import os

import pytest

from fivefold.errors import CliError
from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import FIVEFOLD
from fivefold.planner.search import MAX_WORKERS, PARALLEL_MIN_LAYOUTS, SearchPool, search, search_workers
from fivefold.presets import get_preset


def _run(monkeypatch: pytest.MonkeyPatch, workers: int, *args):
    monkeypatch.setenv("FIVEFOLD_PLAN_WORKERS", str(workers))
    seen: list[tuple[int, int]] = []
    result = search(*args, progress=lambda n, w: seen.append((n, w)))
    return result, seen


def test_a_pool_of_processes_finds_what_one_process_finds(monkeypatch: pytest.MonkeyPatch):
    # an 8B model on one node: some layouts do not fit (a closest misfit), some need recompute, and the pipelined
    # ones run every schedule (DualPipeV's pairs included)
    args = (get_preset("llama3-8b"), 4096, 64, 8, FIVEFOLD, get_cluster("h100"))
    one, seen_one = _run(monkeypatch, 1, *args, None, 0)
    pool, seen_pool = _run(monkeypatch, 2, *args, None, 0)
    assert seen_one == [(one.evaluated, 1)] and seen_pool == [(one.evaluated, 2)]
    assert one.evaluated > 1000 and len(one.candidates) > 1000
    assert {e.layout.schedule for e in one.candidates if e.layout.pp > 1} == {"afab", "1f1b", "interleaved",
                                                                             "zero-bubble", "dualpipev"}
    assert pool.evaluated == one.evaluated
    assert pool.rejected == one.rejected and pool.examples == one.examples
    assert "does not fit in memory even with full recompute" in one.rejected
    assert [dataclasses.asdict(e) for e in pool.candidates] == [dataclasses.asdict(e) for e in one.candidates]
    assert one.closest_misfit is not None
    assert dataclasses.asdict(pool.closest_misfit) == dataclasses.asdict(one.closest_misfit)


def test_the_pool_size(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FIVEFOLD_PLAN_WORKERS", raising=False)
    assert search_workers(PARALLEL_MIN_LAYOUTS - 1) == 1  # a small search: no pool to start
    cores = len(os.sched_getaffinity(0))
    assert search_workers(PARALLEL_MIN_LAYOUTS * 100) == min(cores, MAX_WORKERS)
    monkeypatch.setenv("FIVEFOLD_PLAN_WORKERS", "3")
    assert search_workers(10) == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("FIVEFOLD_PLAN_WORKERS", bad)
        with pytest.raises(CliError, match=f"FIVEFOLD_PLAN_WORKERS = .*{bad}.* whole number >= 1"):
            search_workers(10)


def test_a_pool_that_breaks_leaves_the_work_to_this_process(monkeypatch: pytest.MonkeyPatch, capsys):
    """A pool whose processes die (e.g. a script without `if __name__ == "__main__":`, which they import again) is
    dropped with a one-line warning and the search still returns what one process returns."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    def broken(self, *args, **kwargs):
        raise BrokenProcessPool("a process of the pool ended abruptly")

    args = (get_preset("llama3-8b"), 4096, 16, 8, FIVEFOLD, get_cluster("h100"))
    one, _ = _run(monkeypatch, 1, *args, None, 0)
    monkeypatch.setattr(ProcessPoolExecutor, "map", broken)
    pool, seen = _run(monkeypatch, 2, *args, None, 0)
    err = capsys.readouterr().err
    assert seen == [(one.evaluated, 2)]
    assert err.count("warning: the search's pool of 2 processes failed") == 1 and "FIVEFOLD_PLAN_WORKERS=1" in err
    assert [dataclasses.asdict(e) for e in pool.candidates] == [dataclasses.asdict(e) for e in one.candidates]
    assert pool.rejected == one.rejected


def _same(a, b) -> bool:
    return ([dataclasses.asdict(e) for e in a.candidates] == [dataclasses.asdict(e) for e in b.candidates]
            and a.rejected == b.rejected and a.evaluated == b.evaluated)


def test_one_pool_serves_a_series_of_searches(monkeypatch: pytest.MonkeyPatch):
    """`plan scaling`'s searches (one per node count) share one `SearchPool`: its processes start once for the
    series, again only for another job (here another sequence length), and each search returns what it returns
    alone."""
    from fivefold.planner import search as search_module

    started: list[int] = []

    class Counted(search_module.ProcessPoolExecutor):
        def __init__(self, workers: int, **kwargs) -> None:
            started.append(workers)
            super().__init__(workers, **kwargs)

    cfg, hw = get_preset("llama3-8b"), get_cluster("h100")
    runs = [(4096, 8), (4096, 16), (2048, 16)]  # (sequence length, GPUs)
    monkeypatch.setenv("FIVEFOLD_PLAN_WORKERS", "1")
    alone = [search(cfg, seq, 16, gpus, FIVEFOLD, hw, None, 3) for seq, gpus in runs]
    monkeypatch.setenv("FIVEFOLD_PLAN_WORKERS", "2")
    monkeypatch.setattr(search_module, "ProcessPoolExecutor", Counted)
    with SearchPool() as pool:
        shared = [search(cfg, seq, 16, gpus, FIVEFOLD, hw, None, 3, pool=pool) for seq, gpus in runs]
        assert pool.pool is not None  # kept open for the caller's next search
    assert pool.pool is None and started == [2, 2]
    assert all(_same(a, b) for a, b in zip(alone, shared, strict=True))


def test_a_shared_pool_that_breaks_leaves_the_rest_of_the_series_to_this_process(monkeypatch: pytest.MonkeyPatch,
                                                                                 capsys):
    """A shared pool that breaks warns once; the searches after it run in this process and say so (1 process)."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    def broken(self, *args, **kwargs):
        raise BrokenProcessPool("a process of the pool ended abruptly")

    cfg, hw = get_preset("llama3-8b"), get_cluster("h100")
    monkeypatch.setenv("FIVEFOLD_PLAN_WORKERS", "1")
    alone = [search(cfg, 4096, 16, gpus, FIVEFOLD, hw, None, 3) for gpus in (8, 16)]
    monkeypatch.setenv("FIVEFOLD_PLAN_WORKERS", "2")
    monkeypatch.setattr(ProcessPoolExecutor, "map", broken)
    seen: list[tuple[int, int]] = []
    with SearchPool() as pool:
        shared = [search(cfg, 4096, 16, gpus, FIVEFOLD, hw, None, 3, pool=pool,
                         progress=lambda n, w: seen.append((n, w))) for gpus in (8, 16)]
    assert [w for _, w in seen] == [2, 1]
    assert capsys.readouterr().err.count("warning: the search's pool of 2 processes failed") == 1
    assert all(_same(a, b) for a, b in zip(alone, shared, strict=True))
