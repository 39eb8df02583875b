"""The results store as the read-only commands and the sweep meet it.

`fivefold report` and `fivefold plan validate --results` never change the file they read (another program's
database, an empty file, an earlier release's store: byte for byte the same afterwards), and neither does a
sweep that refuses the file or a `--dry-run`. A store with a bad cell (a status that is not one, JSON that does not
parse, a finished run without its measurements, a column an old store lacks) is refused with one line that names
the store, the run, the column, the value and the rule, before any report file is written. A grid with no run
that can run is refused with its reasons, without a store; a partly dropped grid says why. A report drawn over
an earlier one moves that report's plots aside when it does not draw them again, and says so.

Every store here is written directly (no training run).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import textwrap
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.sweep.report import SPLIT_NOTE
from fivefold.sweep.store import COLUMNS, Store, StoreError, read_rows

GRID = """
steps = 1
warmup = 0
[model]
preset = "tiny"
[train]
device = "cpu"
seq_len = 32
global_batch_size = 4
"""
FINISHED = {"sweep": "s", "model": "tiny", "status": "ok", "n_devices": 1, "config": "{}",
            "step_time_s": 1.0, "tokens_per_s": 100.0, "tokens_per_s_per_device": 100.0, "peak_memory_bytes": 2**20,
            "peak_memory_per_rank": "[1048576]"}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def foreign_db(path: Path) -> Path:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    db.execute("INSERT INTO users VALUES (1, 'ada')")
    db.commit()
    db.close()
    return path


def old_store(path: Path) -> Path:
    """A store of the previous release (`grad_accum`, not `grad_accum_steps`), in rollback-journal mode, with one
    finished run."""
    columns = {("grad_accum" if k == "grad_accum_steps" else k): v for k, v in COLUMNS.items()}
    db = sqlite3.connect(path)
    db.execute(f"CREATE TABLE runs ({', '.join(f'{k} {v}' for k, v in columns.items())})")
    row = {"key": "old1", "label": "tiny | dp1 tp1 z0", **FINISHED, "grad_accum": 4}
    db.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", list(row.values()))
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    return path


def store_with(path: Path, **cells: object) -> Path:
    """A store of this release with one finished run, `cells` written over its row as they are."""
    Store(path).close()
    row = {"key": "run1", "label": "tiny | dp1 tp1 z0", **FINISHED, **cells}
    db = sqlite3.connect(path)
    db.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", list(row.values()))
    db.commit()
    db.close()
    return path


def write_grid(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(textwrap.dedent(body))
    return path


# ---------------------------------------------------------------------------------------------
# Reading never writes


@pytest.mark.parametrize("kind", ["foreign", "empty", "tableless", "old"])
def test_read_only_commands_leave_the_file_as_it_was(tmp_path: Path, kind: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "results.db"
    if kind == "foreign":
        foreign_db(path)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "tableless":  # an SQLite file with a header and no tables
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE t (x)")
        db.execute("DROP TABLE t")
        db.close()
        assert path.stat().st_size > 0
    else:
        old_store(path)
    before = digest(path)
    expect = 0 if kind == "old" else 2
    assert main(["report", str(path), "--out", str(tmp_path / "rep")]) == expect
    assert main(["plan", "validate", "--results", str(path), "--json"]) == expect
    assert main(["sweep", str(write_grid(tmp_path, GRID)), "--results", str(path), "--dry-run"]) == (
        2 if kind == "foreign" else 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("results")) == ["results.db"]
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    if kind != "old":
        assert "results store" in err and str(path) in err
        assert db.execute("PRAGMA user_version").fetchone()[0] == 0
        assert {r[0] for r in db.execute("SELECT name FROM sqlite_master")} == (
            {"users"} if kind == "foreign" else set())
    else:  # read with the old column under the new name, and no column added
        assert [r["grad_accum_steps"] for r in read_rows(path)] == [4]
        assert "grad_accum_steps" not in {r[1] for r in db.execute("PRAGMA table_info(runs)")}
    db.close()


def test_a_sweep_refuses_another_programs_database_before_changing_it(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    path = foreign_db(tmp_path / "app.db")
    before = digest(path)
    assert main(["sweep", str(write_grid(tmp_path, GRID)), "--results", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a fivefold results store" in err and "users" in err
    assert digest(path) == before and not (tmp_path / "app-runs").exists()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_a_newer_store_is_refused_unchanged(tmp_path: Path) -> None:
    path = store_with(tmp_path / "new.db")
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    before = digest(path)
    for read_only in (True, False):
        with pytest.raises(StoreError, match="newer fivefold"):
            Store(path, read_only=read_only)
    assert digest(path) == before


def test_writing_still_makes_and_upgrades_stores(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with Store(empty) as store:  # an empty file named as the results: the sweep makes it a store
        store.record({"key": "a", "status": "crash", "config": {}})
    assert [r["status"] for r in read_rows(empty)] == ["crash"]
    old = old_store(tmp_path / "old.db")
    with Store(old) as store:  # the sweep adds the new column beside the old one
        store.record({"key": "b", "label": "tiny | dp2", **FINISHED, "config": {}, "grad_accum_steps": 2})
    assert {r["key"]: r["grad_accum_steps"] for r in read_rows(old)} == {"old1": 4, "b": 2}
    with sqlite3.connect(old) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# ---------------------------------------------------------------------------------------------
# Bad cells: one line, before any report file


BAD_CELLS = [
    ({"peak_memory_per_rank": "[1,2"}, "peak_memory_per_rank = '[1,2' is not JSON"),
    ({"peak_memory_per_rank": '{"a": 1}'}, "peak_memory_per_rank = '{\"a\": 1}' is not a JSON list"),
    ({"config": "[]"}, "config = '[]' is not a JSON object"),
    ({"prediction": "nope"}, "prediction = 'nope' is not JSON"),
    ({"step_time_s": None}, "step_time_s = None must be a number > 0 in a finished (ok) run"),
    ({"step_time_s": 0}, "step_time_s = 0"),
    ({"tokens_per_s_per_device": -5.0}, "tokens_per_s_per_device = -5.0 is not a finite number >= 0"),
    ({"mfu": "high"}, "mfu = 'high' is not a finite number >= 0"),
    ({"dp": 1.5}, "dp = 1.5 is not an integer"),
    ({"status": "weird"}, "status = 'weird' is not one of ok, oom, crash, timeout, invalid, interrupted"),
    ({"status": "oom", "n_devices": None}, "n_devices = None must be a positive integer"),
    ({"forward_s": 0.1}, "backward_s = None must be set with forward_s, optimizer_s"),
    ({"label": None}, "label = None must be set in a finished (ok) run"),
]


@pytest.mark.parametrize("cells, message", BAD_CELLS, ids=[m.split(" ")[0] for _, m in BAD_CELLS])
def test_a_bad_cell_is_refused_with_the_store_run_column_and_rule(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                  cells: dict, message: str) -> None:
    path = store_with(tmp_path / "results.db", **cells)
    before = digest(path)
    with pytest.raises(StoreError) as info:
        read_rows(path)
    assert str(info.value).startswith(f"{path}: run run1: {message}")
    out = tmp_path / "rep"
    assert main(["report", str(path), "--out", str(out)]) == 2
    assert main(["plan", "validate", "--results", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count(f"{path}: run run1: {message}") == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # one line each
    assert not out.exists()  # nothing of the report written
    assert digest(path) == before


def test_a_store_with_only_the_core_columns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "core.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE runs (key TEXT PRIMARY KEY, sweep TEXT, model TEXT, status TEXT, config TEXT)")
        db.execute("INSERT INTO runs VALUES ('k1', 's', 'tiny', 'crash', '{}')")
    rows = read_rows(path)  # a failed run needs none of the other columns: they read as None
    assert rows[0]["n_devices"] is None and set(COLUMNS) <= set(rows[0])
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO runs VALUES ('k2', 's', 'tiny', 'ok', '{}')")
    out = tmp_path / "rep"
    assert main(["report", str(path), "--out", str(out)]) == 2
    assert main(["plan", "validate", "--results", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("run k2: n_devices = None (the store has no n_devices column) must be a positive integer") == 2
    assert "Traceback" not in err and not out.exists()


def test_validate_names_the_store_and_run_of_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = store_with(tmp_path / "results.db", config=json.dumps({"model": {"bogus": 1}}))
    assert main(["plan", "validate", "--results", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: run run1: config: unknown config field 'model.bogus'" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# Grids with nothing to run


def test_a_grid_with_no_run_that_can_run_is_refused_without_a_store(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    results = tmp_path / "zero.db"
    dropped = write_grid(tmp_path, 'devices = 3\n[model]\npreset = "tiny"\n[layout]\ntp = 2\n[train]\ndevice = "cpu"\n')
    assert main(["sweep", str(dropped), "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "none of the grid's combinations can run: tp x pp x cp does not divide 3 devices (1 combination)" in err
    invalid = write_grid(tmp_path, GRID + "[layout]\nzero = 1\n")
    assert main(["sweep", str(invalid), "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "none of the grid's combinations can run: layout.zero = 1 with layout.dp = 1" in err
    assert len(err.strip().splitlines()) == 1 and "(1 combination)" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "grid.toml"]  # no store, no runs folder


def test_a_partly_dropped_grid_says_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    grid = write_grid(tmp_path, GRID.replace("steps = 1", "devices = [2, 3]\nsteps = 1") + "[layout]\ntp = [1, 2]\n")
    results = tmp_path / "part.db"
    assert main(["sweep", str(grid), "--results", str(results), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 runs in the grid" in out and "1 combinations dropped" in out
    assert "  dropped (1 combination): tp x pp x cp does not divide 3 devices" in out
    assert not results.exists()


# ---------------------------------------------------------------------------------------------
# The report over an earlier one


def test_a_report_moves_aside_the_earlier_reports_plots_it_does_not_draw(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    two = store_with(tmp_path / "two.db", forward_s=0.5, backward_s=0.6, optimizer_s=0.3)
    with Store(two) as store:  # a second finished layout: a throughput plot against dp
        store.record({"key": "run2", "label": "tiny | dp2 tp1 z0", **FINISHED, "n_devices": 2, "dp": 2,
                      "config": {}})
    with sqlite3.connect(two) as db:
        db.execute("UPDATE runs SET dp = 1 WHERE key = 'run1'")
    out = tmp_path / "rep"
    assert main(["report", str(two), "--out", str(out)]) == 0
    first = json.loads((out / "summary.json").read_text())["figures"]
    assert {"throughput_dp.png", "step_breakdown.png"} <= set(first)
    capsys.readouterr()
    one = store_with(tmp_path / "one.db", status="crash")
    assert main(["report", str(one), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["figures"] == ["status.png"]
    assert sorted(p.name for p in out.glob("*.png")) == ["status.png"]
    for name in set(first) - {"status.png"}:
        assert (out / f"{name}.bak").read_bytes()[:4] == b"\x89PNG"
        assert f"moved the earlier report's plot {out / name} aside to {name}.bak" in said
    assert not (out / "index.html.bak").exists() and not (out / "summary.json.bak").exists()


def test_a_report_says_which_of_the_users_files_it_moved_aside(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.html").write_text("my page\n")
    (out / "summary.json").write_text('{"runs": 1}\n')  # not a report's summary
    assert main(["report", str(store_with(tmp_path / "r.db", status="crash")), "--out", str(out)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert f"fivefold report: moved the existing file {out / 'index.html'} aside to index.html.bak" in said
    assert f"fivefold report: moved the existing file {out / 'summary.json'} aside to summary.json.bak" in said
    assert (out / "index.html.bak").read_text() == "my page\n"


def test_the_page_says_the_split_need_not_add_up(tmp_path: Path) -> None:
    path = store_with(tmp_path / "r.db", step_time_s=1.2904, forward_s=0.6827, backward_s=0.9432,
                      optimizer_s=0.1821)
    out = tmp_path / "rep"
    assert main(["report", str(path), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert "682.7 / 943.2 / 182.1 (sum 140 % of the step)" in page
    assert SPLIT_NOTE.split(",")[0] in page and "need not add up to the step time" in page
