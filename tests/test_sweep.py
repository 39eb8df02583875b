"""`fivefold sweep`, its results store and `fivefold report`.

The grid tests check the expansion against the config and layout validators themselves. The real sweep (a
tiny model on one and two gloo processes) is killed, together with its run in flight, once its first run is
recorded, and run again: the store must end with one row per run, the first one untouched. Its rows are then
checked against what `fivefold bench` measures (tokens per step, ranks), the report is drawn from it, and
`fivefold plan validate --results` reads it. Two processes write one store at once; a sweep whose every run
fails (a crash, a timeout, an invalid layout) still gets a report that says why; SLURM mode writes its scripts,
and (slow) runs end to end with stand-ins for sbatch, srun and scontrol.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.config import ConfigError, build_config, config_from_dict
from fivefold.faults import descendants as _descendants
from fivefold.layout import check_layout
from fivefold.sweep.grid import expand, load_grid, run_key
from fivefold.sweep.store import Store, read_rows

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}
SMALL = """
[model]
preset = "tiny"
n_layers = 1
hidden = 64
n_heads = 4
n_kv_heads = 2
ffn = 128
vocab_size = 256

[train]
seq_len = 32
global_batch_size = 8
device = "cpu"
dtype = "fp32"
threads = 1
"""


def write_grid(tmp_path: Path, body: str, name: str = "grid.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# ---------------------------------------------------------------------------------------------
# Grid expansion


def test_grid_expands_the_product_and_filters_with_the_validators(tmp_path):
    grid = load_grid(write_grid(tmp_path, 'name = "g"\nsteps = 3\nwarmup = 1\ndevices = [1, 2, 4]\n' + SMALL + """
        [layout]
        tp = [1, 2, 4]
        zero = [0, 1]
        """))
    plans, dropped = expand(grid)
    # 3 device counts x 3 tp x 2 zero = 18 combinations; tp not dividing the devices is dropped: tp2 on 1 device,
    # tp4 on 1 and 2 devices, each with 2 zero stages
    assert len(plans) == 18 - 6 and sum(dropped.values()) == 6
    for plan in plans:
        la = plan.cfg.layout
        assert la.dp * la.tp == plan.n_devices and plan.n_devices in (1, 2, 4)  # dp fills the devices
        try:
            plan.cfg.validate()
            check_layout(plan.cfg, plan.n_devices)
            expected = None
        except ConfigError as e:
            expected = str(e)
        assert plan.invalid == expected, plan.label
    invalid = {(p.cfg.layout.dp, p.cfg.layout.tp, p.cfg.layout.zero) for p in plans if p.invalid}
    # zero > 0 needs dp >= 2; tp = 4 does not divide the 2 kv heads
    assert invalid == {(1, 1, 1), (1, 2, 1), (1, 4, 0), (1, 4, 1)}
    assert len({p.key for p in plans}) == len(plans)
    assert all(p.cfg.train.max_steps == 4 for p in plans)


def test_grid_union_keys_and_errors(tmp_path):
    path = write_grid(tmp_path, "steps = 2\n" + SMALL + """
        [[grid]]
        devices = 2
        layout = { tp = [1, 2] }

        [[grid]]
        devices = 1
        layout = { micro_batch_size = [2, 4, 8] }
        """)
    plans, _ = expand(load_grid(path))
    assert sorted((p.n_devices, p.cfg.layout.tp, p.cfg.micro_batch_size) for p in plans) == [
        (1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 1, 4), (2, 2, 8)]
    # the key is the config and the protocol: stable across loads, blind to paths and logging, not to steps
    again, _ = expand(load_grid(path))
    assert [p.key for p in plans] == [p.key for p in again]
    cfg = plans[0].cfg
    key = run_key(cfg, 2, 2)
    cfg.run_dir, cfg.log.log_every = "elsewhere", 7
    assert run_key(cfg, 2, 2) == key and run_key(cfg, 3, 2) != key
    cfg.layout.recompute = "full"
    assert run_key(cfg, 2, 2) != key
    # grid errors stop the sweep, naming the key
    with pytest.raises(ConfigError, match="layout.dpp"):
        expand(load_grid(write_grid(tmp_path, "[layout]\ndpp = [1, 2]\n", "bad1.toml")))
    with pytest.raises(ConfigError, match="'stepz'"):
        load_grid(write_grid(tmp_path, "stepz = 3\n", "bad2.toml"))
    with pytest.raises(ConfigError, match="devices"):
        load_grid(write_grid(tmp_path, "devices = [0, 2]\n", "bad3.toml"))


def documented_key(cfg, steps: int, warmup: int) -> str:
    """The run key as docs/sweeps.md defines it (and as every store so far was written): the first 16 hex digits of
    the SHA-256 of the config without the run directory, the log and data sections and the long run's step counts
    and schedule, with the steps and warm-up."""
    import hashlib

    data = {k: v for k, v in cfg.to_dict().items() if k not in ("run_dir", "log", "data")}
    data["train"] = {k: v for k, v in data["train"].items() if k not in (
        "max_steps", "warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints")}
    text = json.dumps({"config": data, "steps": steps, "warmup": warmup}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_a_derived_micro_batch_and_the_same_one_given_share_a_key(tmp_path, capsys):
    """`layout.micro_batch_size = 0` (the whole per-rank batch) and that number given explicitly are one run: the
    same micro-batch and accumulation, the same bench command, so one key (a grid that lists both has one run; a
    store that holds one runs neither again). Every other run keeps the key that stores already hold."""
    from fivefold.sweep.runner import bench_argv

    path = write_grid(tmp_path, "steps = 2\nwarmup = 1\n" + SMALL + """
        [[grid]]
        devices = 1
        layout = { micro_batch_size = [0, 2, 8] }

        [[grid]]
        devices = 2
        layout = { micro_batch_size = [0, 2, 4] }
        """)
    plans, _ = expand(load_grid(path))
    shapes = {p.key: (p.n_devices, p.micro_batch_size, p.grad_accum_steps) for p in plans}
    # 8 on one device and 4 on two are the whole per-rank batch: the runs of 0, not new ones
    assert sorted(shapes.values()) == [(1, 2, 4), (1, 8, 1), (2, 2, 2), (2, 4, 1)]
    for plan in plans:
        given = dataclasses.replace(plan.cfg, layout=dataclasses.replace(plan.cfg.layout,
                                                                         micro_batch_size=plan.micro_batch_size))
        # the reference: both spellings run the same bench command
        assert bench_argv(plan, tmp_path, 2, 1) == bench_argv(
            dataclasses.replace(plan, cfg=given), tmp_path, 2, 1)
        assert run_key(given, 2, 1) == plan.key
        # the key stores hold: a micro-batch below the whole batch as it was given; the whole batch as 0, the key of
        # every grid that leaves the micro-batch out (the first spelling in the grid, 0, is the run kept)
        assert plan.cfg.layout.micro_batch_size == (plan.micro_batch_size if plan.grad_accum_steps > 1 else 0)
        assert plan.key == documented_key(plan.cfg, 2, 1), plan.label
    # a store that recorded the derived run does not run the explicit one again
    derived = next(p for p in plans if p.n_devices == 1 and p.grad_accum_steps == 1)
    results = tmp_path / "r.db"
    with Store(results) as store:
        store.record({"key": derived.key, "status": "crash", "label": derived.label, "model": derived.model,
                      "error": "boom", "n_devices": 1, "config": derived.cfg.to_dict()}, replace_statuses=())
    explicit = write_grid(tmp_path, "steps = 2\nwarmup = 1\ndevices = 1\n" + SMALL + """
        [layout]
        micro_batch_size = 8
        """, "explicit.toml")
    assert main(["sweep", str(explicit), "--results", str(results), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 already in" in out and "0 to run" in out, out


def _cfg(**fields):
    """A small valid config (the grid's SMALL model on the CPU in fp32) with `fields` (dotted names) over it."""
    base = {"model.n_layers": 4, "model.hidden": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn": 128,
            "model.vocab_size": 256, "train.seq_len": 32, "train.global_batch_size": 8, "train.device": "cpu",
            "train.dtype": "fp32", "train.threads": 1}
    return build_config(None, {**base, **fields})


def _engine_reads(cfg) -> dict:
    """What the engine resolves each derived field of `cfg` to, read through the engine's own code: the expert
    width, the head width, the pipeline split (`pipeline.stage_layer_counts`), the gradient bucket (Megatron's rule
    written out here), the four overlaps it switches on, the compute dtype (`device.use_bf16`), the micro-batch."""
    from fivefold.device import use_bf16
    from fivefold.parallel.pipeline import stage_layer_counts

    m, la = cfg.model, cfg.layout
    return {"expert_ffn": m.moe_ffn or m.ffn, "head_dim": m.head_dim,
            "stages": stage_layer_counts(cfg) if la.pp > 1 else None,
            "bucket": (la.dp_bucket_size or max(40_000_000, 1_000_000 * la.dp * la.cp)) if la.zero < 3 else None,
            "overlaps": (la.overlaps_param_gather, la.overlaps_pp_comm, la.overlaps_fb, la.overlaps_tp_comm),
            "bf16": use_bf16(cfg, cfg.train.device.split(":")[0]),
            "micro_batch": la.micro_batch_size or cfg.train.global_batch_size // la.dp}


def _valid(cfg) -> bool:
    try:
        cfg.validate()
        check_layout(cfg, cfg.layout.world_size)
    except ConfigError:
        return False
    return True


# (the layout, the field, a value given explicitly that the engine runs exactly as the default)
SAME_RUN = [
    ({"model.n_experts": 4}, "model.moe_ffn", 128),  # 0 = ffn
    ({}, "model.moe_ffn", 128),  # a dense model: no experts either way
    ({}, "model.head_size", 16),  # null = hidden / n_heads
    ({"layout.pp": 2, "layout.micro_batch_size": 2}, "layout.stage_layers", "balanced"),  # [] = by compute
    ({"layout.pp": 2, "layout.schedule": "interleaved", "layout.vpp": 2, "layout.micro_batch_size": 2},
     "layout.stage_layers", "balanced"),
    ({"layout.dp": 2, "layout.zero": 1}, "layout.dp_bucket_size", 40_000_000),  # null = Megatron's rule
    ({"layout.dp": 2, "layout.zero": 1}, "layout.dp_overlap_param_gather", True),  # null = on where it applies
    ({"layout.dp": 2}, "layout.dp_overlap_param_gather", False),  # ... and off where it does not (ZeRO-0)
    ({"layout.pp": 2, "layout.micro_batch_size": 2}, "layout.pp_comm_overlap", True),
    ({}, "layout.pp_comm_overlap", False),
    ({"layout.pp": 2, "layout.tp": 2, "layout.schedule": "dualpipev", "layout.micro_batch_size": 2},
     "layout.pp_fb_overlap", True),
    ({"layout.pp": 2, "layout.micro_batch_size": 2}, "layout.pp_fb_overlap", False),
    ({"layout.tp": 2, "layout.sp": True}, "layout.tp_comm_overlap", True),
    ({"layout.tp": 2}, "layout.tp_comm_overlap", False),
    ({"layout.dp": 2}, "layout.micro_batch_size", 4),  # 0 = the whole per-rank batch
]
# (the layout, the field, a value that is another run, a refused one, or one whose meaning depends on the machine)
OTHER_RUN = [
    ({"model.n_experts": 4}, "model.moe_ffn", 64),
    ({}, "model.head_size", 32),
    ({"layout.pp": 2, "layout.micro_batch_size": 2}, "layout.stage_layers", "unbalanced"),
    ({"layout.dp": 2, "layout.zero": 1}, "layout.dp_bucket_size", 1_000),
    ({"layout.dp": 2, "layout.zero": 3}, "layout.dp_bucket_size", 40_000_000),  # refused: ZeRO-3 has no buckets
    ({"layout.dp": 2, "layout.zero": 1}, "layout.dp_overlap_param_gather", False),
    ({"layout.dp": 2}, "layout.dp_overlap_param_gather", True),  # refused where it does not apply
    ({"layout.pp": 2, "layout.micro_batch_size": 2}, "layout.pp_comm_overlap", False),
    ({}, "layout.pp_comm_overlap", True),
    ({"layout.tp": 2, "layout.sp": True}, "layout.tp_comm_overlap", False),
    # on where it applies, but refused under float8, whose linears run no collective under their matmuls
    ({"layout.tp": 2, "layout.sp": True, "train.float8": "rowwise"}, "layout.tp_comm_overlap", True),
    ({"layout.dp": 4, "layout.zero": 3}, "layout.dp_shard", 4),  # refused: HSDP needs dp_shard < dp
    ({}, "model.sliding_window", 32),  # the whole sequence, through the windowed kernels
    ({}, "train.threads", 0),  # this machine's cores: its meaning depends on the machine
    ({"train.device": "auto"}, "train.dtype", "auto"),  # bf16 or fp32 by the machine's accelerator
    ({"train.device": "cuda", "train.dtype": "auto"}, "train.dtype", "fp32"),
]


def _spelled(layout: dict, field: str, value):
    """The config of `layout`, and the same with `field` given `value` (a pipeline split named by how it is made)."""
    default = _cfg(**layout)
    if value in ("balanced", "unbalanced"):
        from fivefold.parallel.pipeline import stage_layer_counts

        split = stage_layer_counts(default)
        value = split if value == "balanced" else [split[0] + 1, split[1] - 1, *split[2:]]
    return default, _cfg(**{**layout, field: value})


@pytest.mark.parametrize(("layout", "field", "value"), SAME_RUN, ids=lambda v: str(v))
def test_a_derived_default_and_the_value_it_means_share_a_key(layout, field, value):
    """Each field whose default (0, null, []) the engine resolves from the rest of the config, given explicitly the
    value it resolves to, is the same run (the engine reads the same values; both valid), so one key: the key
    stores already hold for the default, which grids that leave the field out have always had."""
    default, given = _spelled(layout, field, value)
    assert given.to_dict() != default.to_dict()
    assert _engine_reads(given) == _engine_reads(default) and _valid(given) and _valid(default)
    assert run_key(given, 2, 1) == run_key(default, 2, 1) == documented_key(default, 2, 1)


def test_dtype_auto_on_a_named_device_is_the_dtype_it_resolves_to():
    """`train.dtype = "auto"` on a named device is bf16 on an accelerator and fp32 on the CPU: keyed as that
    dtype, what the grids that name it (examples/sweep-cpu.toml) have always been keyed as."""
    for device, dtype in (("cpu", "fp32"), ("cuda", "bf16"), ("cuda:1", "bf16")):
        named, auto = _cfg(**{"train.device": device, "train.dtype": dtype}), _cfg(**{"train.device": device,
                                                                                       "train.dtype": "auto"})
        assert _engine_reads(auto) == _engine_reads(named)
        assert run_key(auto, 2, 1) == run_key(named, 2, 1) == documented_key(named, 2, 1)


@pytest.mark.parametrize(("layout", "field", "value"), OTHER_RUN, ids=lambda v: str(v))
def test_a_value_that_is_another_run_keeps_its_own_key(layout, field, value):
    """A value that the engine runs otherwise than the default, or that a validator refuses where the default is
    not, or whose meaning depends on the machine (train.threads = 0, dtype under device = auto), keeps the key its
    spelling always had."""
    default, given = _spelled(layout, field, value)
    assert given.to_dict() != default.to_dict()
    machine = field == "train.threads" or given.train.device == "auto"
    assert machine or _engine_reads(given) != _engine_reads(default) or _valid(given) != _valid(default) or (
        field == "model.sliding_window" and given.model.masks_attention != default.model.masks_attention)
    assert run_key(given, 2, 1) == documented_key(given, 2, 1) != run_key(default, 2, 1)


def test_a_grid_and_a_store_hold_each_run_once_however_it_is_spelled(tmp_path, capsys):
    """A grid that gives a run with its defaults and again with the values they mean has one run; a store that
    holds it does not run the second spelling."""
    path = write_grid(tmp_path, "steps = 2\nwarmup = 1\n" + SMALL + """
        [[grid]]
        devices = 2
        layout = { zero = 1 }

        [[grid]]
        devices = 2
        model = { head_size = 16 }
        train = { dtype = "auto" }
        [grid.layout]
        zero = 1
        dp_overlap_param_gather = true
        dp_bucket_size = 40000000
        tp_comm_overlap = false
        pp_comm_overlap = false
        pp_fb_overlap = false
        micro_batch_size = 4
        """)
    plans, _ = expand(load_grid(path))
    assert len(plans) == 1 and plans[0].invalid is None, [p.label for p in plans]
    assert plans[0].key == documented_key(plans[0].cfg, 2, 1)
    results = tmp_path / "r.db"
    with Store(results) as store:
        store.record({"key": plans[0].key, "status": "crash", "label": plans[0].label, "model": plans[0].model,
                      "error": "boom", "n_devices": 2, "config": plans[0].cfg.to_dict()}, replace_statuses=())
    explicit = write_grid(tmp_path, "steps = 2\nwarmup = 1\ndevices = 2\n" + SMALL + """
        [layout]
        zero = 1
        dp_overlap_param_gather = true
        dp_bucket_size = 40000000
        """, "explicit.toml")
    assert main(["sweep", str(explicit), "--results", str(results), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 already in" in out and "0 to run" in out, out


# ---------------------------------------------------------------------------------------------
# A real sweep, interrupted and resumed


def _sweep_cmd(grid: Path, results: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fivefold", "sweep", str(grid), "--results", str(results), *extra]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A sweep of three runs (two on one process, one on two) and an invalid layout, killed with its run in
    flight after the first run is recorded, then run again to the end."""
    tmp = tmp_path_factory.mktemp("sweep")
    grid = write_grid(tmp, 'name = "t"\nsteps = 2\nwarmup = 1\ntimeout = 240\n' + SMALL + """
        [[grid]]
        devices = 1
        layout = { micro_batch_size = [2, 8], zero = 0 }

        [[grid]]
        devices = [1, 2]
        layout = { zero = 1, micro_batch_size = 4 }
        """)
    results = tmp / "results.db"
    proc = subprocess.Popen(_sweep_cmd(grid, results), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    first: list[dict] = []
    while time.monotonic() < deadline and proc.poll() is None:
        if results.exists():
            first = [r for r in read_rows(results) if r["status"] == "ok"]
            if first:
                break
        time.sleep(0.3)
    family = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the sweep dies without a chance to clean up, its run in flight with it
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first_out = proc.communicate()[0]
    assert len(first) >= 1, first_out
    after_kill = read_rows(results)
    done = subprocess.run(_sweep_cmd(grid, results), env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return {"grid": grid, "results": results, "after_kill": after_kill, "resume_out": done.stdout, "tmp": tmp}


def test_killed_sweep_resumes_with_one_row_per_run(swept):
    rows = read_rows(swept["results"])
    assert len(rows) == 4 and len({r["key"] for r in rows}) == 4
    assert sorted(r["status"] for r in rows) == ["invalid", "ok", "ok", "ok"]
    invalid = next(r for r in rows if r["status"] == "invalid")
    assert "layout.zero = 1 with layout.dp = 1" in invalid["error"]
    # the runs recorded before the kill were not run again: their rows are unchanged
    ok_before = [r for r in swept["after_kill"] if r["status"] == "ok"]
    by_key = {r["key"]: r for r in rows}
    for r in ok_before:
        assert by_key[r["key"]]["finished_at"] == r["finished_at"]
        assert by_key[r["key"]]["step_time_s"] == r["step_time_s"]
    out = swept["resume_out"]
    assert f"{len(ok_before)} already in" in out
    assert out.count(" ok ") == 3 - len(ok_before)  # one line per finished run, only the rest ran
    # and a third time there is nothing left to do
    again = subprocess.run(_sweep_cmd(swept["grid"], swept["results"]), env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert "3 already in" in again.stdout and "0 to run" in again.stdout
    assert len(read_rows(swept["results"])) == 4


def test_stored_measurements_are_consistent(swept):
    rows = [r for r in read_rows(swept["results"]) if r["status"] == "ok"]
    for r in rows:
        cfg = config_from_dict(r["config"])
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(tokens, rel=1e-9)
        assert r["tokens_per_s_per_device"] * r["n_devices"] == pytest.approx(r["tokens_per_s"], rel=1e-9)
        assert len(r["peak_memory_per_rank"]) == r["n_devices"] == cfg.layout.world_size
        assert r["peak_memory_bytes"] == max(r["peak_memory_per_rank"]) > 0
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        assert r["predicted_step_time_s"] > 0 and r["predicted_peak_memory_bytes"] > 0 and r["hardware"] == "cpu"
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / r["peak_tflops"], rel=1e-9)
        assert r["key"] == run_key(cfg, r["steps"], r["warmup"])
    two = next(r for r in rows if r["n_devices"] == 2)
    assert (two["dp"], two["zero"], two["micro_batch_size"], two["grad_accum_steps"]) == (2, 1, 4, 1)


# ---------------------------------------------------------------------------------------------
# Concurrent writers


WRITER = """
import random, sys, time
from fivefold.sweep.store import Store
me, path = sys.argv[1], sys.argv[2]
store = Store(path)
for i in range(40):
    key = f"k{i:03d}" if i % 2 else f"{me}-{i:03d}"  # odd keys are written by both writers
    payload = {"writer": me, "i": i, "pad": "x" * random.randint(0, 5000)}
    # a failed run's row (a finished one needs its measurements to be read back)
    store.record({"key": key, "status": "crash", "label": me, "model": me, "error": me, "n_devices": i,
                  "config": payload}, replace_statuses=("crash",))
    time.sleep(random.random() * 0.01)
"""


def test_two_writers_never_corrupt_each_others_rows(tmp_path):
    path = tmp_path / "shared.db"
    Store(path).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, name, str(path)], env=ENV) for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rows = read_rows(path)
    assert len(rows) == 20 + 20 + 20  # 20 own keys each, 20 shared keys once
    for r in rows:  # every row is whole: all its columns from one writer's one record
        me = r["label"]
        assert r["model"] == r["error"] == r["config"]["writer"] == me and r["n_devices"] == r["config"]["i"]
        if not r["key"].startswith("k"):
            assert r["key"].startswith(me)


# ---------------------------------------------------------------------------------------------
# The report


def _ranks(x: list[float]) -> np.ndarray:
    return np.argsort(np.argsort(np.asarray(x)))


def test_report_from_the_store(swept, tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(swept["results"]), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    page = (out / "index.html").read_text()
    for name in ["status.png", "mfu_heatmap.png", "memory.png", "predicted_vs_measured.png", "step_breakdown.png",
                 "throughput_micro_batch_size.png", "throughput_dp.png", "throughput_zero.png"]:
        assert name in summary["figures"], name
    for name in summary["figures"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 5000
        assert f"src='{name}'" in page and f"href='{name}'" in page
    # the accuracy printed on the page is the median error and rank correlation of the stored columns
    ok = [r for r in read_rows(swept["results"]) if r["status"] == "ok"]
    pred = [r["predicted_step_time_s"] for r in ok]
    meas = [r["step_time_s"] for r in ok]
    err = statistics.median(abs(p / m - 1) for p, m in zip(pred, meas, strict=True))
    assert summary["accuracy"]["step_time"]["median_abs_error"] == pytest.approx(err)
    if len(set(pred)) == len(pred):
        rho = float(np.corrcoef(_ranks(pred), _ranks(meas))[0, 1])
        assert summary["accuracy"]["step_time"]["spearman"] == pytest.approx(rho)
    assert f"{100 * err:.1f} %" in page
    best = max((r for r in ok if r["n_devices"] == 1), key=lambda r: r["tokens_per_s_per_device"])
    assert any(b["key"] == best["key"] for b in summary["best"])
    assert "layout.zero = 1 with layout.dp = 1" in page  # the invalid run says why
    # drawn again into the same folder: the earlier report is replaced, nothing kept beside it
    assert main(["report", str(swept["results"]), "--out", str(out)]) == 0
    assert not list(out.glob("*.bak*")) and json.loads((out / "summary.json").read_text()) == summary
    # into a folder of the user's: a file of the same name is kept as NAME.bak, the others are left alone
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.html").write_text("my page\n")
    (mine / "notes.txt").write_text("my notes\n")
    assert main(["report", str(swept["results"]), "--out", str(mine)]) == 0
    assert (mine / "index.html.bak").read_text() == "my page\n" and (mine / "notes.txt").read_text() == "my notes\n"
    assert "<html" in (mine / "index.html").read_text().lower()


def test_report_of_a_sweep_where_every_run_failed(tmp_path):
    # a crash (a model that fivefold bench refuses when it starts: its planned memory, terabytes, fits no machine;
    # a document mask or a device this machine lacks is refused before any run), an invalid layout, and a
    # two-process run cut by the timeout
    too_big = SMALL.replace("n_layers = 1\nhidden = 64\nn_heads = 4\nn_kv_heads = 2\nffn = 128",
                            "n_layers = 64\nhidden = 16384\nn_heads = 128\nn_kv_heads = 8\nffn = 65536")
    crash = write_grid(tmp_path, 'name = "fails"\nsteps = 1\nwarmup = 0\n' + too_big + """
        [layout]
        zero = [0, 1]
        """, "crash.toml")
    slow = write_grid(tmp_path, 'name = "fails"\nsteps = 1\nwarmup = 0\ndevices = 2\n' + SMALL, "slow.toml")
    results = tmp_path / "failed.db"
    assert main(["sweep", str(crash), "--results", str(results)]) == 0
    assert main(["sweep", str(slow), "--results", str(results), "--timeout", "2", "--runs", str(tmp_path / "r")]) == 0
    rows = {r["status"]: r for r in read_rows(results)}
    assert set(rows) == {"crash", "invalid", "timeout"}
    assert "the planner predicts a peak of" in rows["crash"]["error"] and "error" in rows["crash"]["error"]
    assert rows["timeout"]["error"] == "timed out after 2 s"
    # the timed-out run's processes are gone: none has its run folder on its command line
    folder = str(tmp_path / "r")
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert folder not in cmdline.read_text()
        except (FileNotFoundError, ProcessLookupError):
            pass
    out = tmp_path / "report"
    assert main(["report", str(results), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert (out / "status.png").exists() and not (out / "mfu_heatmap.png").exists()
    assert "No run finished" in page
    for r in rows.values():
        assert r["status"] in page and html.escape(r["error"]) in page
    assert html.escape(rows["crash"]["error_tail"].splitlines()[-1]) in page


# ---------------------------------------------------------------------------------------------
# plan validate on the store


def test_plan_validate_reads_the_store(swept, capsys):
    assert main(["plan", "validate", "--results", str(swept["results"]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"]
    ok = [r for r in read_rows(swept["results"]) if r["status"] == "ok"]
    assert result["rows"] == result["finished"] == len(ok) == 3
    assert set(result["groups"]) == {"tiny/1 dev", "tiny/2 dev"}
    # validate predicts as the sweep did (the same built-in profile): the same step-time error
    err = statistics.median(abs(r["predicted_step_time_s"] / r["step_time_s"] - 1) for r in ok)
    assert result["median_step_time_error"] == pytest.approx(err)
    assert main(["plan", "validate", "--results", str(swept["results"])]) == 0
    assert "median step-time error" in capsys.readouterr().out
    assert main(["plan", "validate", "--results", str(swept["tmp"] / "missing.db")]) == 2


# ---------------------------------------------------------------------------------------------
# SLURM mode


FAKE_SBATCH = """#!/bin/bash
# stand-in for sbatch: runs the job at once on this machine, its output where #SBATCH --output says
out=$(sed -n 's/^#SBATCH --output=//p' "$1")
SLURM_JOB_ID=4242 SLURM_NNODES=1 SLURM_JOB_NODELIST=localhost bash "$1" > "$out" 2>&1 || true
echo "Submitted batch job 4242"
"""


def _slurm_setup(tmp_path: Path) -> tuple[Path, Path, Path, dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", '#!/bin/bash\nexec "$@"\n'),
                       ("scontrol", "#!/bin/bash\necho localhost\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    grid = write_grid(tmp_path, 'name = "s"\nsteps = 1\nwarmup = 0\ntimeout = 120\n' + SMALL + """
        [[grid]]
        devices = 1

        [[grid]]
        devices = 12
        train = { global_batch_size = 24 }
        """)
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return grid, tmp_path / "s.db", tmp_path / "jobs", env


def test_slurm_mode_writes_one_script_per_run(tmp_path, capsys):
    grid, results, jobs, _ = _slurm_setup(tmp_path)
    # without --submit: scripts only; 12 devices are not whole nodes of 8
    assert main(["sweep", str(grid), "--results", str(results), "--slurm", str(jobs)]) == 0
    out = capsys.readouterr().out
    assert "1 skipped (not whole nodes of 8)" in out and "wrote 1 scripts" in out
    (script,) = jobs.glob("*/job.sh")
    text = script.read_text()
    assert "#SBATCH --nodes=1" in text and "--nproc-per-node 1 " in text and "#SBATCH --time=00:02:00" in text
    assert "--gpus-per-node" not in text  # a CPU grid's job asks for no GPU
    assert "--module fivefold bench" in text and f"--out {script.parent / 'result.json'}" in text
    assert f"#SBATCH --output={script.parent / 'output.log'}" in text and "exit_status" in text
    assert (script.parent / "config.toml").exists() and read_rows(results) == []
    # with 4 GPUs per node the 12-device run spans 3 nodes
    assert main(["sweep", str(grid), "--results", str(results), "--slurm", str(jobs), "--gpus-per-node", "4"]) == 0
    twelve = [p for p in jobs.glob("*/job.sh") if "--nodes=3" in p.read_text()]
    assert len(twelve) == 1 and "--nproc-per-node 4 " in twelve[0].read_text()
    assert "--gpus-per-node" not in twelve[0].read_text()
    assert main(["sweep", str(grid), "--results", str(results), "--submit"]) == 2  # --submit needs --slurm


@pytest.mark.slow
def test_slurm_mode_submits_and_records(tmp_path):
    grid, results, jobs, env = _slurm_setup(tmp_path)
    # --submit runs the job (the stand-in sbatch runs it at once); the next call records it
    done = subprocess.run(_sweep_cmd(grid, results, "--slurm", str(jobs), "--submit"), env=env,
                          capture_output=True, text=True, timeout=300)
    assert "submitted 4242" in done.stdout, done.stdout + done.stderr
    (script,) = jobs.glob("*/job.sh")
    assert (script.parent / "exit_status").read_text().strip() == "0", (script.parent / "output.log").read_text()
    done = subprocess.run(_sweep_cmd(grid, results, "--slurm", str(jobs)), env=env, capture_output=True, text=True,
                          timeout=120)
    assert "recorded 1 ended jobs" in done.stdout, done.stdout + done.stderr
    (row,) = read_rows(results)
    assert row["status"] == "ok" and row["n_devices"] == 1 and row["nodes"] == 1 and row["tokens_per_s"] > 0
    # recorded runs are not written or submitted again
    done = subprocess.run(_sweep_cmd(grid, results, "--slurm", str(jobs), "--submit"), env=env,
                          capture_output=True, text=True, timeout=120)
    assert "1 already in" in done.stdout and "submitted 0" in done.stdout
