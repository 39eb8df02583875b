"""One name per concept: micro_batch_size, grad_accum_steps, tokens_per_s_per_device, parameters/gradients; the
previous names stay readable where a file holds them (plan --json writes both, an earlier release's store reads
under the new name)."""

from __future__ import annotations

import json
import sqlite3

from fivefold.cli import main
from fivefold.planner.layout import Layout, parse_layout
from fivefold.sweep.store import COLUMNS, Store, read_rows


def test_plan_json_has_the_new_names_and_the_previous_ones(capsys):
    rc = main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--seq-len", "128",
               "--global-batch", str(128 * 8), "--json", "--layout", "dp=2,micro_batch_size=2"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    lay = data["layout"]
    assert (lay["micro_batch_size"], lay["grad_accum_steps"]) == (2, 2) == (lay["mbs"], lay["grad_acc"])
    assert data["tokens_per_s_per_device"] == data["tokens_per_s_per_gpu"] > 0
    assert {"parameters", "gradients", "optimizer"} <= set(data["memory_bytes"]["first"])


def test_layout_accepts_mbs_as_short_for_micro_batch_size():
    assert parse_layout("dp=2,mbs=4", 16) == parse_layout("dp=2,micro_batch_size=4", 16)
    lay = parse_layout("dp=2,mbs=4", 16)
    assert isinstance(lay, Layout) and (lay.micro_batch_size, lay.grad_accum_steps) == (4, 2)
    assert lay.to_layout_config().micro_batch_size == 4


def test_a_previous_releases_store_reads_under_both_names(tmp_path):
    path = tmp_path / "old.sqlite"
    old_columns = {("grad_accum" if k == "grad_accum_steps" else k): v for k, v in COLUMNS.items()}
    db = sqlite3.connect(path)
    db.execute(f"CREATE TABLE runs ({', '.join(f'{k} {v}' for k, v in old_columns.items())})")
    # what a finished run's row holds besides its layout (the store refuses an ok row without its measurements)
    finished = {"status": "ok", "config": "{}", "model": "tiny", "label": "tiny | dp1", "n_devices": 1,
                "step_time_s": 1.0, "tokens_per_s": 8.0, "tokens_per_s_per_device": 8.0, "peak_memory_bytes": 1}
    old = {"key": "a", **finished, "grad_accum": 4}
    db.execute(f"INSERT INTO runs ({', '.join(old)}) VALUES ({', '.join('?' for _ in old)})", list(old.values()))
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    with Store(path) as store:
        store.record({"key": "b", **finished, "grad_accum_steps": 2})
    rows = {r["key"]: r for r in read_rows(path)}
    assert (rows["a"]["grad_accum_steps"], rows["b"]["grad_accum_steps"]) == (4, 2)
    assert "grad_accum" not in rows["a"] and "grad_accum" not in rows["b"]  # one name per concept
