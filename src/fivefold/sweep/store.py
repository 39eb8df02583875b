"""The results store: one SQLite file, one row per run, keyed by the run key.

The file is in WAL mode; every row is written in its own `BEGIN IMMEDIATE` transaction when its run finishes,
so a killed sweep loses at most the run in flight, and sweeps writing the same file at once queue on SQLite's
lock (a busy timeout of a minute) instead of interleaving half rows. A row that is already there is kept
unless the writer asks to replace it (a re-validated invalid run, or a retried failure).

Columns (one row per run; JSON columns hold text):

    key TEXT PRIMARY KEY       hash of the normalised config and the protocol (fivefold.sweep.grid.run_key)
    sweep, label, model        the grid's name, "model | layout" and the model's label
    status                     ok, oom, crash, timeout, invalid, or interrupted (started, and the sweep was
                               stopped or killed before it ended; run again by the next sweep)
    error, error_tail          the error's message (one line) and the last lines of the run's output
    n_devices, nodes, dp, tp, pp, cp, ep, zero, micro_batch_size, grad_accum_steps, recompute, sp, schedule, vpp,
    seq_len, global_batch_size  the layout and batch, also inside config
    config                     the full Config as JSON
    steps, warmup              the measurement protocol
    step_time_s, tokens_per_s, tokens_per_s_per_device, tflops_per_device, mfu, peak_tflops
    forward_s, backward_s, optimizer_s   the step split (NULL when the engine cannot split it)
    peak_memory_bytes          the largest rank's peak; peak_memory_per_rank: JSON list; memory_source: what it is
    predicted_step_time_s, predicted_tokens_per_s_per_device, predicted_mfu, predicted_peak_memory_bytes,
    predicted_fits, prediction (JSON: time and memory by part), hardware (the profile's name)
    device, device_name, torch, host, started_at, finished_at, wall_s

A store written by an earlier release has `grad_accum` where this one has `grad_accum_steps`: a sweep that writes
to it adds the new column (nothing is removed or rewritten), and its rows read with the old column's values under
the new name.

Reading (`read_rows`, and `Store(path, read_only=True)`) opens the file read-only: it never changes the file, not
even its journal mode. Writing (`Store(path)`) first checks that the file is empty or a fivefold store (not
another program's database, not a newer schema), and only then creates the table and switches to WAL.

Every row read is checked (`check_row`): its status is one of STATUSES, its JSON columns parse, its numbers are
numbers, and a finished (ok) run has the measurements every reader needs. A column that an older store lacks
reads as None. A bad cell is refused with one line naming the store, the run, the column, the value and the rule.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import urllib.parse
from collections.abc import Collection
from pathlib import Path
from typing import Any

from fivefold.config import one_line, shown

SCHEMA_VERSION = 1
COLUMNS: dict[str, str] = {
    "key": "TEXT PRIMARY KEY", "sweep": "TEXT", "label": "TEXT", "model": "TEXT", "status": "TEXT NOT NULL",
    "error": "TEXT", "error_tail": "TEXT", "n_devices": "INTEGER", "nodes": "INTEGER",
    "dp": "INTEGER", "tp": "INTEGER", "pp": "INTEGER", "cp": "INTEGER", "ep": "INTEGER", "zero": "INTEGER",
    "micro_batch_size": "INTEGER", "grad_accum_steps": "INTEGER", "recompute": "TEXT", "sp": "INTEGER",
    "schedule": "TEXT", "vpp": "INTEGER", "seq_len": "INTEGER", "global_batch_size": "INTEGER",
    "config": "TEXT NOT NULL", "steps": "INTEGER", "warmup": "INTEGER",
    "step_time_s": "REAL", "tokens_per_s": "REAL", "tokens_per_s_per_device": "REAL", "tflops_per_device": "REAL",
    "mfu": "REAL", "peak_tflops": "REAL", "forward_s": "REAL", "backward_s": "REAL", "optimizer_s": "REAL",
    "peak_memory_bytes": "INTEGER", "peak_memory_per_rank": "TEXT", "memory_source": "TEXT",
    "predicted_step_time_s": "REAL", "predicted_tokens_per_s_per_device": "REAL", "predicted_mfu": "REAL",
    "predicted_peak_memory_bytes": "REAL", "predicted_fits": "INTEGER", "prediction": "TEXT", "hardware": "TEXT",
    "device": "TEXT", "device_name": "TEXT", "torch": "TEXT", "host": "TEXT", "started_at": "TEXT",
    "finished_at": "TEXT", "wall_s": "REAL",
}
# columns renamed since an earlier release: old name -> new name (an old store's rows read under the new name)
RENAMED = {"grad_accum": "grad_accum_steps"}
STATUSES = ("ok", "oom", "crash", "timeout", "invalid", "interrupted")
JSON_COLUMNS = ("config", "peak_memory_per_rank", "prediction")
CORE = ("key", "sweep", "model", "status", "config")  # in every release's store
NUMBER_COLUMNS = tuple(k for k, v in COLUMNS.items() if v.startswith(("INTEGER", "REAL")))
TEXT_COLUMNS = tuple(k for k, v in COLUMNS.items() if v.startswith("TEXT") and k not in JSON_COLUMNS)
# what every reader of a finished run needs (report: tables and plots; plan validate: the measured figures)
OK_POSITIVE = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device")
OK_PRESENT = ("model", "label", "peak_memory_bytes")
SPLIT = ("forward_s", "backward_s", "optimizer_s")


class StoreError(Exception):
    """The file is not a fivefold results store (or a newer one), or a row of it holds a bad value."""


class Store:
    """A results store: `Store(path)` to write (the file is created, or checked and resumed), `Store(path,
    read_only=True)` to read an existing file without changing it."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        try:
            if read_only:
                uri = "file:" + urllib.parse.quote(os.fsencode(self.path.absolute())) + "?mode=ro"
                self.db = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None)
            else:
                if str(path) != ":memory:":
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                # autocommit mode: transactions are opened explicitly, one per written row
                self.db = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{self.path} cannot be opened as an SQLite results store ({e})") from None
        try:
            self.columns = self._inspect() if read_only else self._create()
        except sqlite3.DatabaseError as e:
            self.db.close()
            raise StoreError(f"{self.path} is not an SQLite results store ({e}); give a new file name or an "
                             "existing store written by `fivefold sweep`") from None
        except BaseException:
            self.db.close()
            raise

    def _inspect(self) -> set[str]:
        """The columns of the file's runs table (none: a file without tables), refusing another program's
        database, a runs table that is not a store's, and a newer schema; reads only."""
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} was written by a newer fivefold (schema {version}; this one reads "
                             f"{SCHEMA_VERSION}); use that release")
        if tables and "runs" not in tables:
            raise StoreError(f"{self.path} is an SQLite file but not a fivefold results store (no runs table; it "
                             f"holds {one_line(', '.join(sorted(tables)[:5]))}); give a new file name or a store "
                             "written by `fivefold sweep`")
        have = {r[1] for r in self.db.execute("PRAGMA table_info(runs)")}
        if tables and (missing := [c for c in CORE if c not in have]):
            raise StoreError(f"{self.path} has a runs table, but not a fivefold results store's (no "
                             f"{', '.join(missing)} column); give a new file name or a store written by "
                             "`fivefold sweep`")
        return have

    def _create(self) -> set[str]:
        """Check the file (`_inspect`), then make it a store: the table, the columns added since an earlier
        release, the schema version, WAL mode. Nothing is changed in a file that is refused."""
        self.db.execute("PRAGMA busy_timeout = 60000")
        self.db.execute("BEGIN IMMEDIATE")
        try:
            have = self._inspect()
            columns = ", ".join(f"{k} {v}" for k, v in COLUMNS.items())
            self.db.execute(f"CREATE TABLE IF NOT EXISTS runs ({columns})")
            have = {r[1] for r in self.db.execute("PRAGMA table_info(runs)")}
            for old, new in RENAMED.items():
                if old in have and new not in have:  # a previous release's store: add the new column beside it
                    self.db.execute(f"ALTER TABLE runs ADD COLUMN {new} {COLUMNS[new]}")
                    have.add(new)
            if self.db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        self.db.execute("PRAGMA journal_mode = WAL")
        return have

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statuses(self) -> dict[str, str]:
        """key -> status of every recorded run (none when the file has no runs table yet)."""
        if not self.columns:
            return {}
        return dict(self.db.execute("SELECT key, status FROM runs").fetchall())

    def status(self, key: str) -> str | None:
        if not self.columns:
            return None
        row = self.db.execute("SELECT status FROM runs WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def row(self, key: str) -> dict[str, Any] | None:
        if not self.columns:
            return None
        cur = self.db.execute("SELECT * FROM runs WHERE key = ?", (key,))
        values = cur.fetchone()
        return None if values is None else self._decode([d[0] for d in cur.description], values)

    def record(self, row: dict[str, Any], replace_statuses: tuple[str, ...] = ()) -> bool:
        """Write one run in one transaction. A row already stored under the key is kept unless its status
        is in `replace_statuses`; returns whether this row was written."""
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown store columns: {sorted(unknown)}")
        if row.get("status") not in STATUSES:
            raise ValueError(f"status {shown(row.get('status'))} is not one of {STATUSES}")
        values = {k: (json.dumps(v) if k in JSON_COLUMNS and not isinstance(v, str) and v is not None else v)
                  for k, v in row.items()}
        names = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        self.db.execute("BEGIN IMMEDIATE")
        try:
            old = self.db.execute("SELECT status FROM runs WHERE key = ?", (row["key"],)).fetchone()
            if old is not None and old[0] not in replace_statuses:
                self.db.execute("COMMIT")
                return False
            self.db.execute(f"INSERT OR REPLACE INTO runs ({names}) VALUES ({marks})", list(values.values()))
            self.db.execute("COMMIT")
            return True
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def rows(self) -> list[dict[str, Any]]:
        """Every run as a dict (every column of COLUMNS; None where the store lacks it), JSON columns decoded,
        each checked (`check_row`), in the order they were recorded."""
        if not self.columns:
            return []
        cur = self.db.execute("SELECT * FROM runs ORDER BY rowid")
        names = [d[0] for d in cur.description]
        return [self._decode(names, values) for values in cur.fetchall()]

    def _decode(self, names: list[str], values: tuple) -> dict[str, Any]:
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row.update(zip(names, values, strict=True))
        for old, new in RENAMED.items():  # the new name, whichever release wrote the row
            value = row.pop(old, None)
            if row.get(new) is None:
                row[new] = value
        missing = set(COLUMNS) - set(names) - {new for old, new in RENAMED.items() if old in names}
        return check_row(row, self.path, missing)


def check_row(row: dict[str, Any], path: Path, missing: Collection[str] = ()) -> dict[str, Any]:
    """`row` as read from the store at `path`, its JSON columns decoded; a StoreError naming the store, the run,
    the column, the value and the rule at the first bad cell. `missing`: the columns the store lacks."""

    def bad(column: str, value: object, rule: str) -> StoreError:
        absent = f" (the store has no {column} column)" if column in missing else ""
        return StoreError(f"{path}: run {one_line(str(row.get('key')))}: {column} = {shown(value)}{absent} {rule}")

    if row["status"] not in STATUSES:
        raise bad("status", row["status"], f"is not one of {', '.join(STATUSES)}")
    for column in JSON_COLUMNS:
        text = row[column]
        if text is None and column != "config":
            continue
        if not isinstance(text, str):
            raise bad(column, text, "is not JSON text")
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            raise bad(column, text, "is not JSON") from None
        if column == "peak_memory_per_rank":
            if not isinstance(value, list) or not all(_number(x) and x >= 0 for x in value):
                raise bad(column, text, "is not a JSON list of byte counts (numbers >= 0)")
        elif not isinstance(value, dict):
            raise bad(column, text, "is not a JSON object")
        row[column] = value
    for column in NUMBER_COLUMNS:
        value = row[column]
        if value is None:
            continue
        if not _number(value) or value < 0:
            raise bad(column, value, "is not a finite number >= 0")
        if COLUMNS[column] == "INTEGER" and not isinstance(value, int):
            raise bad(column, value, "is not an integer")
    for column in TEXT_COLUMNS:
        if row[column] is not None and not isinstance(row[column], str):
            raise bad(column, row[column], "is not text")
    if row["status"] in ("ok", "oom") and not (row["n_devices"] or 0) > 0:
        raise bad("n_devices", row["n_devices"], f"must be a positive integer in a run whose status is "
                                                 f"{row['status']}")
    if row["status"] == "ok":
        for column in OK_POSITIVE:
            if not (row[column] or 0) > 0:
                raise bad(column, row[column], "must be a number > 0 in a finished (ok) run")
        for column in OK_PRESENT:
            if row[column] is None:
                raise bad(column, None, "must be set in a finished (ok) run")
        if any(row[c] is None for c in SPLIT) and any(row[c] is not None for c in SPLIT):
            column = next(c for c in SPLIT if row[c] is None)
            raise bad(column, None, f"must be set with {', '.join(c for c in SPLIT if c != column)} (the step split "
                                    "is stored whole or not at all)")
    return row


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an existing store, each checked (`check_row`); the file is opened read-only and left as it
    was. Refuses a path that is not a store, and a file without a runs table."""
    path = Path(path)
    if path.is_dir():
        raise StoreError(f"results file {shown(str(path))} is a directory; give the store's file (written by "
                         "`fivefold sweep GRID.toml --results FILE`)")
    if not path.is_file():
        raise StoreError(f"results file {shown(str(path))} does not exist; write one with `fivefold sweep GRID.toml "
                         f"--results {path}`")
    try:
        with Store(path, read_only=True) as store:
            if not store.columns:
                raise StoreError(f"{path} is not a fivefold results store yet (an empty file: no runs table); write "
                                 f"one with `fivefold sweep GRID.toml --results {path}`")
            return store.rows()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path} is not a fivefold results store: {e}") from None
