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

A store written by an earlier release has `grad_accum` where this one has `grad_accum_steps`: opening it adds
the new column (nothing is removed or rewritten), and its rows read with the old column's values under the new
name.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from fivefold.config import shown

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


class StoreError(Exception):
    """The file is not a fivefold results store (or a newer one)."""


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # autocommit mode: transactions are opened explicitly, one per written row
        self.db = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
        try:
            self.db.execute("PRAGMA busy_timeout = 60000")
            self.db.execute("PRAGMA journal_mode = WAL")
        except sqlite3.DatabaseError as e:
            self.db.close()
            raise StoreError(f"{self.path} is not an SQLite results store ({e}); give a new file name or an "
                             "existing store written by `fivefold sweep`") from None
        self.db.execute("BEGIN IMMEDIATE")
        try:
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} was written by a newer fivefold (schema {version})")
            if tables and "runs" not in tables:
                raise StoreError(f"{self.path} is an SQLite file but not a fivefold results store (no runs table)")
            columns = ", ".join(f"{k} {v}" for k, v in COLUMNS.items())
            self.db.execute(f"CREATE TABLE IF NOT EXISTS runs ({columns})")
            have = {r[1] for r in self.db.execute("PRAGMA table_info(runs)")}
            core = ("key", "sweep", "model", "status", "config")  # in every release's store
            if missing := [c for c in core if c not in have]:
                raise StoreError(f"{self.path} has a runs table, but not a fivefold results store's (no "
                                 f"{', '.join(missing)} column); give a new file name or a store written by "
                                 "`fivefold sweep`")
            for old, new in RENAMED.items():
                if old in have and new not in have:  # a previous release's store: add the new column beside it
                    self.db.execute(f"ALTER TABLE runs ADD COLUMN {new} {COLUMNS[new]}")
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statuses(self) -> dict[str, str]:
        """key -> status of every recorded run."""
        return dict(self.db.execute("SELECT key, status FROM runs").fetchall())

    def status(self, key: str) -> str | None:
        row = self.db.execute("SELECT status FROM runs WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def row(self, key: str) -> dict[str, Any] | None:
        cur = self.db.execute("SELECT * FROM runs WHERE key = ?", (key,))
        values = cur.fetchone()
        return None if values is None else _decode([d[0] for d in cur.description], values)

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
        """Every run as a dict, JSON columns decoded, in the order they were recorded."""
        cur = self.db.execute("SELECT * FROM runs ORDER BY rowid")
        names = [d[0] for d in cur.description]
        return [_decode(names, values) for values in cur.fetchall()]


def _decode(names: list[str], values: tuple) -> dict[str, Any]:
    row = dict(zip(names, values, strict=True))
    for old, new in RENAMED.items():  # the new name, whichever release wrote the row
        value = row.pop(old, None)
        if row.get(new) is None:
            row[new] = value
    for k in JSON_COLUMNS:
        if row.get(k) is not None:
            row[k] = json.loads(row[k])
    return row


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an existing store (refuses a path that is not one)."""
    path = Path(path)
    if path.is_dir():
        raise StoreError(f"results file {shown(str(path))} is a directory; give the store's file (written by "
                         "`fivefold sweep GRID.toml --results FILE`)")
    if not path.is_file():
        raise StoreError(f"results file {shown(str(path))} does not exist; write one with `fivefold sweep GRID.toml "
                         f"--results {path}`")
    try:
        with Store(path) as store:
            return store.rows()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path} is not a fivefold results store: {e}") from None
