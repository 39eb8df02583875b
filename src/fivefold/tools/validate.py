"""`fivefold plan validate`: model published (or fivefold's own) runs and compare.

Each row is modelled with its framework's settings (the playbook rows: nanotron, see `NANOTRON`) on its
hardware (the playbook's cluster: `h100-efa`, whose collective bandwidths are the playbook's own measurements).
Constants fitted to data are fitted on the 1- and 2-node rows only; the metrics are printed separately for
those rows ("fitted") and for the rest ("held out"):

* fits/OOM agreement: predicted peak <= device memory, against finished vs crashed/OOM;
* median relative error of the predicted peak memory over the finished runs;
* Spearman correlation of predicted vs measured tokens/s per GPU inside each (model, nodes) group;
* top-1 regret inside each group: 1 - measured tokens/s of the predicted best / the measured best. The
  predicted best is chosen among the rows predicted to fit; a pick that crashed counts as a regret of 100 %.
  The regret of the pick among the finished rows only is printed beside it;
* median relative error of the predicted step time, and the Spearman correlation of predicted vs measured
  step time over all finished rows.

`--results FILE` reads a `fivefold sweep` results store instead: its runs that finished or ran out of memory
(crashes, timeouts and invalid layouts say nothing about the model), each predicted as `fivefold sweep` does
(fivefold's own settings, `--hardware FILE` or the built-in profile of the device kind, all of a local run's
processes on one node), grouped by (model, device count).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from fivefold.config import ConfigError, ModelConfig, config_from_dict, one_line, shown
from fivefold.errors import CliError
from fivefold.layout import SCHEDULES
from fivefold.outputs import check_target, keep_previous
from fivefold.planner import profile
from fivefold.planner.features import FEATURES, with_features
from fivefold.planner.hardware import Cluster, get_cluster
from fivefold.planner.layout import FRAMEWORKS, RECOMPUTE, Framework, Layout
from fivefold.planner.predict import compute_dtype, estimate_run, layout_of, load_hardware, on_one_node
from fivefold.planner.profile import all_frameworks
from fivefold.planner.score import spearman
from fivefold.planner.search import estimate, gib, memory_of
from fivefold.planner.time import handovers, stage_split_problem
from fivefold.sweep.store import StoreError
from fivefold.sweep.store import read_rows as read_store
from fivefold.tools.gates import Record, format_gates, gates, is_stalled, stall_counts

DATA_NAME = "playbook_benchmark_runs.csv"


def _checkout_data() -> Path | None:
    """The runs CSV that a clone of the repository finds: `../shared/data/playbook_benchmark_runs.csv` beside the
    checkout (the directory that holds pyproject.toml and src/fivefold). None when the package is installed
    outside a checkout (the data is not shipped with it): then `--data FILE` says where it is."""
    package = Path(__file__).resolve().parents[1]  # .../fivefold
    for root in package.parents:
        if (root / "pyproject.toml").is_file() and (root / "src" / "fivefold").resolve() == package:
            return root.parent / "shared" / "data" / DATA_NAME
    return None


DEFAULT_DATA = _checkout_data()
DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "planner" / "profiles" / "nanotron-h100-efa.toml"
FIT_NODES = (1, 2)


@dataclasses.dataclass
class Row:
    model: ModelConfig
    layout: Layout
    nodes: int
    seq: int
    ok: bool
    tok_s_gpu: float
    mem_gib: float
    framework: str
    group: tuple
    step_time_s: float = 0.0  # measured; 0 = derive it from tokens/s per GPU
    estimate: object = None  # the prediction when the reader makes it (store rows)
    features: tuple[str, ...] = ()  # what the run used beyond the layout (`features` column: compile+float8, ...)
    held_out: bool | None = None  # the `split` column (fit / held-out); None: by node count (FIT_NODES)

    @property
    def measured_step_time(self) -> float:
        if self.step_time_s:
            return self.step_time_s
        tokens = self.layout.dp * self.layout.micro_batch_size * self.layout.grad_accum_steps * self.seq
        return tokens / (self.tok_s_gpu * self.layout.world_size) if self.tok_s_gpu else 0.0


def read_runs_csv(path: Path) -> list[Row]:
    if not path.is_file():
        raise CliError(
            f"--data {shown(str(path))} does not exist. `plan validate` needs the 3,264 runs of the benchmark "
            f"figure of "
            "the Ultra-Scale Playbook (Hugging Face, 2025) as a CSV, playbook_benchmark_runs.csv, which this package "
            "does not ship: it is extracted from the figure's embedded data (GitHub vinjn/nanotron-ultrascale-"
            "playbook, assets/data/benchmarks/benchmarks_interactive.html) and kept in ../shared/data beside the "
            "repository; give its path with --data FILE, or check the planner on your own runs with --results STORE")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"--data {shown(str(path))} cannot be read as UTF-8 text ({e.reason} at byte {e.start}); give "
                       "the runs CSV") from None
    except OSError as e:
        raise CliError(f"--data {shown(str(path))} cannot be read: {e.strerror or e}") from None
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    if not header:
        raise CliError(f"--data {shown(str(path))} holds no runs (the file is empty; it needs a header line and a "
                       "row per run)")
    missing = [c for c in RUNS_COLUMNS if c not in header]
    if missing:
        raise CliError(f"--data {shown(str(path))} lacks the column(s) {', '.join(missing)}; a runs CSV needs "
                       f"{', '.join(RUNS_COLUMNS)}")
    rows = []
    try:
        for r in reader:
            rows.append(_run_row(r, path, len(rows) + 1, len(header)))
    except csv.Error as e:
        raise CliError(f"--data {shown(str(path))}, row {len(rows) + 1}: not valid CSV ({e})") from None
    if not rows:
        raise CliError(f"--data {shown(str(path))} holds no runs (a header line and no rows)")
    return rows


# the columns every runs CSV has (the others: optional, with the defaults `_run_row` says)
RUNS_COLUMNS = ("model", "n_layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied_emb", "seq_len", "nodes",
                "dp", "tp", "pp", "mbs", "grad_acc", "zero", "status", "tok_s_gpu", "mem_gb")
# numbers a row may carry that the model does not read: checked all the same (a nan there is a broken extraction)
_OTHER_NUMBERS = ("gpus", "n_params", "gbs_seqs", "mfu_pct", "mfu_recomputed_pct", "tok_s")
# a run's status: finished, or not (the playbook's file says crashed_or_oom; either way it did not fit or run)
CSV_STATUSES = ("ok", "oom", "crash", "crashed_or_oom", "timeout")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _run_row(r: dict, path: Path, index: int, columns: int) -> Row:
    """Row `index` (1 = the first after the header) of a runs CSV, each value checked with its column named."""
    where = f"--data {shown(str(path))}, row {index}"
    if None in r or None in r.values():  # DictReader: extra cells under the key None, missing ones as None
        cells = columns + len(r.get(None) or ()) - sum(v is None for k, v in r.items() if k is not None)
        raise CliError(f"{where} has {cells} cells; the header has {columns} columns")

    def integer(column: str, default: str | None = None) -> int:
        text = (r.get(column) or default or "").strip() if default is not None else r[column].strip()
        try:
            return int(text)
        except ValueError:
            raise CliError(f"{where}: {column} = {shown(r.get(column))} is not an integer") from None

    def positive(column: str, default: str | None = None, least: int = 1) -> int:
        value = integer(column, default)
        if value < least:
            raise CliError(f"{where}: {column} = {value} must be >= {least}")
        return value

    def number(column: str) -> float:
        try:
            value = float(r[column])
        except ValueError:
            raise CliError(f"{where}: {column} = {shown(r[column])} is not a number") from None
        if not math.isfinite(value):
            raise CliError(f"{where}: {column} = {shown(r[column])} must be a finite number")
        return value

    def boolean(column: str) -> bool:
        text = (r.get(column) or "").strip().lower()
        if text and text not in _TRUE + _FALSE:
            raise CliError(f"{where}: {column} = {shown(r[column])} is not true or false")
        return text in _TRUE

    def one_of(column: str, allowed: tuple[str, ...], default: str) -> str:
        value = (r.get(column) or "").strip() or default
        if value not in allowed:
            raise CliError(f"{where}: {column} = {shown(value)} is not one of {', '.join(allowed)}")
        return value

    for column in _OTHER_NUMBERS:
        if (r.get(column) or "").strip():
            number(column)
    status = one_of("status", CSV_STATUSES, "")
    tied = boolean("tied_emb")
    heads = integer("heads")
    cfg = ModelConfig(name=r["model"], n_layers=integer("n_layers"), hidden=integer("hidden"),
                      n_heads=heads, n_kv_heads=integer("kv_heads") if r["kv_heads"].strip() else heads,
                      ffn=integer("ffn"), vocab_size=integer("vocab"), max_seq_len=integer("seq_len"),
                      tied_embeddings=tied, mlp=(r.get("mlp") or "swiglu").strip().lower())
    cfg.validate(f"--data {path.name}: a row of {r['model']}: model")
    framework = r.get("framework") or "nanotron"
    tp = positive("tp")
    zero = integer("zero")
    if zero not in (0, 1, 2, 3):
        raise CliError(f"{where}: zero = {zero} is not one of 0, 1, 2, 3")
    lay = Layout(dp=positive("dp"), tp=tp, pp=positive("pp"), cp=positive("cp", "1"), ep=positive("ep", "1"),
                 zero=zero, micro_batch_size=positive("mbs"), grad_accum_steps=positive("grad_acc"),
                 recompute=one_of("recompute", RECOMPUTE, "none"),
                 sp=boolean("sp") if framework != "nanotron" else tp > 1,
                 schedule=one_of("schedule", SCHEDULES, "1f1b"), vpp=positive("vpp", "1"),
                 fp32_grad_accum=framework == "nanotron" or boolean("fp32_grad_accum"))
    if (r.get("gpus") or "").strip() and lay.world_size != integer("gpus"):
        raise CliError(f"{where}: dp x tp x pp x cp = {lay.dp} x {lay.tp} x {lay.pp} x {lay.cp} = {lay.world_size} "
                       f"but gpus = {integer('gpus')}; the layout's degrees multiply to the GPUs of the run")
    ok = status == "ok"
    if ok:  # a finished run's measurements: tokens/s it must have, memory where it was recorded
        if not r["tok_s_gpu"].strip() or number("tok_s_gpu") <= 0:
            raise CliError(f"{where}: tok_s_gpu = {shown(r['tok_s_gpu'])}; a run with status ok needs its tokens/s "
                           "per GPU, a number > 0")
        if r["mem_gb"].strip() and number("mem_gb") < 0:
            raise CliError(f"{where}: mem_gb = {shown(r['mem_gb'])} must be >= 0 (or empty where not measured)")
    split = (r.get("split") or "").strip()
    if split not in ("", "fit", "held-out"):
        raise CliError(f"{where}: split = {shown(split)}; use 'fit' or 'held-out' (or leave it empty: rows of 1-2 "
                       "nodes are fitted, the rest held out)")
    nodes = positive("nodes")
    return Row(cfg, lay, nodes, positive("seq_len"), ok, number("tok_s_gpu") if ok and r["tok_s_gpu"] else 0.0,
               number("mem_gb") if ok and r["mem_gb"] else 0.0, framework, (r["model"], nodes),
               features=tuple(f for f in (r.get("features") or "").split("+") if f),
               held_out=None if not split else split == "held-out")


def read_results(path: Path, hardware_file: str | None) -> tuple[list[Row], list[str]]:
    """The runs of a `fivefold sweep` store that finished or ran out of memory, with the planner's estimate; and
    the profiles the sweep itself predicted with that differ from the ones these estimates use."""
    try:
        stored = read_store(path)
    except StoreError as e:
        raise CliError(f"--results: {e}") from None
    profiles: dict[str, Cluster] = {}  # device kind -> the profile its runs are estimated with
    other: set[str] = set()
    rows = []
    for r in stored:
        where = f"--results {path}: run {one_line(str(r['key']))}"
        try:
            cfg = config_from_dict(r["config"])
        except ConfigError as e:
            raise CliError(f"{where}: config: {e}") from None
        device_type = "cpu" if (r.get("device") or cfg.train.device).split(":")[0] == "cpu" else "accelerator"
        if device_type not in profiles:
            profiles[device_type] = load_hardware(hardware_file, device_type)
        hw = profiles[device_type]
        if r.get("hardware") and r["hardware"] != hw.name:
            other.add(r["hardware"])
        if r["status"] not in ("ok", "oom"):
            continue
        if (r.get("nodes") or 1) == 1:  # a local run: every process on one node
            hw = on_one_node(hw, r["n_devices"])
        ok = r["status"] == "ok"
        try:
            framework = "fivefold-cpu" if compute_dtype(cfg, device_type) == "fp32" else "fivefold"
            estimate = estimate_run(cfg, hw, device_type)
        except (ConfigError, ValueError, ZeroDivisionError) as e:  # a config the planner cannot model
            raise CliError(f"{where}: config: the planner cannot model it ({e})") from None
        rows.append(Row(cfg.model, layout_of(cfg), r.get("nodes") or 1, cfg.train.seq_len, ok,
                        r["tokens_per_s_per_device"] if ok else 0.0,
                        r["peak_memory_bytes"] / 2**30 if ok else 0.0, framework,
                        (r["model"], f"{r['n_devices']} dev"), r["step_time_s"] if ok else 0.0, estimate))
    if not rows:
        raise CliError(f"--results {shown(str(path))} holds no run that finished or ran out of memory")
    return rows, sorted(other)


def load_profile(path: Path | None) -> tuple[Framework, Cluster]:
    """The fitted constants: a profile (`fivefold.planner.profile`; framework fields under [framework],
    hardware fields at the top level or under [hardware]), nanotron on `h100-efa` where it names neither. A refusal
    names the flag the file came from, --profile (the profile readers name --hardware, `plan`'s flag)."""
    try:
        fw, hw = profile.load(path or DEFAULT_PROFILE, None, "h100-efa")
    except ConfigError as e:
        if path is None:
            raise
        text = str(e)
        raise ConfigError(f"--profile{text.removeprefix('--hardware')}" if text.startswith("--hardware")
                          else f"--profile {shown(str(path))}: {text}") from None
    return fw or FRAMEWORKS["nanotron"], hw


# ---------------------------------------------------------------------------------------------
# Fitting (1- and 2-node rows only)


def fit_memory(rows: list[Row], fw: Framework) -> Framework:
    """Least squares on relative error: measured = states + a * activations + l * logits elements + c."""
    xs, ys = [], []
    for r in rows:
        if not r.ok:
            continue
        unit = dataclasses.replace(fw, activation_scale=1.0, logits_bytes=1.0, fixed_overhead_gib=0.0)
        mem = memory_of(r.model, r.seq, r.layout, unit)
        # the rank with the larger measured-like total: take the first rank unless the last is larger
        parts = max(mem.values(), key=lambda p: sum(p.values()))
        fixed = sum(v for k, v in parts.items() if k not in ("activations", "transient", "fixed_overhead"))
        xs.append((parts["activations"], parts["transient"], 1.0 * 2**30, fixed))
        ys.append(r.mem_gib * 2**30)
    # weighted normal equations for (a, l, c) with y - fixed as the target, weights 1 / y^2
    import numpy as np

    a = np.array([[x[0], x[1], x[2]] for x in xs]) / np.array(ys)[:, None]
    b = (np.array(ys) - np.array([x[3] for x in xs])) / np.array(ys)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    scale, logits, overhead = (max(float(c), 0.0) for c in coef)
    fw = dataclasses.replace(fw, activation_scale=round(scale, 4), logits_bytes=round(logits, 3),
                             fixed_overhead_gib=round(overhead, 3))
    # the share of the device a run may use before it fails: the best fits/OOM agreement on these rows
    peaks = [max(sum(p.values()) for p in memory_of(r.model, r.seq, r.layout, fw).values())
             for r in rows]
    invalid = [r.layout.pp > r.model.n_layers or stage_split_problem(r.model, r.layout, fw) is not None for r in rows]
    hbm = get_cluster("h100-efa").memory_bytes

    def agreement(frac: float) -> int:
        return sum(((pk <= frac * hbm) and not bad) == r.ok for pk, bad, r in zip(peaks, invalid, rows, strict=True))

    frac = max((f / 100 for f in range(80, 101)), key=lambda f: (agreement(f), f))
    return dataclasses.replace(fw, usable_memory_fraction=frac)


# the time constants `fit_time` fits, each with the values it tries: (table, field, grid)
TIME_GRID = (
    ("hardware", "matmul_efficiency", tuple(round(0.4 + 0.025 * i, 3) for i in range(17))),
    ("hardware", "kernel_overhead_us", (5.0, 10.0, 20.0, 40.0)),
    ("framework", "tp_overlap", (0.0, 0.25, 0.5)),
    ("framework", "host_us_per_layer", (0.0, 3000.0, 3500.0, 4000.0, 4500.0, 5000.0, 5500.0)),
    ("framework", "cross_node_pp_us_per_layer_tp", (0.0, 1500.0, 1750.0, 2000.0, 2250.0, 2500.0, 2750.0, 3000.0)),
)
# the latency of one ring step between nodes, fitted on the rows whose tensor-parallel group spans nodes (tp16 on
# 2 nodes: eight collectives per block and micro-batch, latency bound at micro-batch 1; the mean |log| error over
# these few rows); elsewhere it hardly moves the median, so the whole-row fit cannot identify it
LATENCY_GRID = (5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 80.0, 100.0)


# the coarse grid searched whole before the coordinate descent (every 2nd or 3rd value of TIME_GRID)
COARSE_GRID = {"matmul_efficiency": (0.45, 0.5, 0.55, 0.6), "kernel_overhead_us": (5.0, 10.0, 20.0),
               "tp_overlap": (0.0, 0.25), "host_us_per_layer": (4000.0, 4500.0, 5000.0),
               "cross_node_pp_us_per_layer_tp": (1750.0, 2000.0, 2250.0, 2500.0, 2750.0)}


def _set(fw: Framework, hw: Cluster, values: dict) -> tuple[Framework, Cluster]:
    tables = {name: table for table, name, _ in TIME_GRID}
    return (dataclasses.replace(fw, **{k: v for k, v in values.items() if tables[k] == "framework"}),
            dataclasses.replace(hw, **{k: v for k, v in values.items() if tables[k] == "hardware"}))


def fit_time(rows: list[Row], fw: Framework, hw: Cluster) -> tuple[Framework, Cluster]:
    """The time constants that minimise the median absolute log error of tokens/s per GPU: every combination
    of `COARSE_GRID`, then coordinate descent over `TIME_GRID` from the best (each constant in turn set to its
    best grid value, until a whole round changes nothing). The per-node pipeline wait of the previous model is
    not fitted (set to 0): the host terms replace it."""
    ok = [r for r in rows if r.ok]
    hw = dataclasses.replace(hw, pp_sync_us_per_node=0.0, drift_per_node_doubling=0.0)  # the drift: `fit_stall`

    def score(f2: Framework, h2: Cluster, among: list[Row] = ok, average=statistics.median) -> float:
        return average(abs(math.log(estimate(r.model, r.seq, r.layout, f2, h2, False).tokens_per_s_per_device
                                    / r.tok_s_gpu)) for r in among)

    cross_tp = [r for r in ok if r.layout.tp * r.layout.cp > hw.gpus_per_node]

    def fit_latency(f2: Framework, h2: Cluster) -> Cluster:
        if not cross_tp:
            return h2
        return min((dataclasses.replace(h2, inter_latency_us=v) for v in LATENCY_GRID),
                   key=lambda h: score(f2, h, cross_tp, statistics.fmean))

    hw = fit_latency(fw, hw)
    best = math.inf
    names = list(COARSE_GRID)
    for combo in itertools.product(*COARSE_GRID.values()):
        f2, h2 = _set(fw, hw, dict(zip(names, combo, strict=True)))
        s = score(f2, h2)
        if s < best - 1e-12:
            best, best_fw, best_hw = s, f2, h2
    fw, hw = best_fw, best_hw
    for _ in range(10):
        changed = False
        for table, name, values in TIME_GRID:
            for value in values:
                f2 = dataclasses.replace(fw, **{name: value}) if table == "framework" else fw
                h2 = dataclasses.replace(hw, **{name: value}) if table == "hardware" else hw
                s = score(f2, h2)
                if s < best - 1e-12:
                    best, fw, hw, changed = s, f2, h2, True
        latency = fit_latency(fw, hw)
        if latency.inter_latency_us != hw.inter_latency_us:
            hw, best, changed = latency, score(fw, latency), True
        if not changed:
            break
    return fw, hw


def fit_matmul_efficiency(rows: list[Row], fw: Framework, hw: Cluster) -> Cluster:
    """The large-GEMM efficiency alone (which also scales the attention figures, `planner/time.py`) that
    minimises the median absolute log error of tokens/s per GPU on `rows` (e.g. one named row): a grid of 0.0025
    from 0.20 to 0.99, each row modelled with its own framework and features."""
    known = all_frameworks()
    ok = [r for r in rows if r.ok]
    if not ok:
        raise CliError("--fit --fit-fields matmul_efficiency: no finished row to fit on (the rows with split = fit)")

    def score(value: float) -> float:
        h2 = dataclasses.replace(hw, matmul_efficiency=value)
        return statistics.median(abs(math.log(estimate(r.model, r.seq, r.layout, row_framework(r, fw, known), h2,
                                                      False).tokens_per_s_per_device / r.tok_s_gpu)) for r in ok)

    best = min((round(0.20 + 0.0025 * i, 4) for i in range(317)), key=score)
    return dataclasses.replace(hw, matmul_efficiency=best)


FIT_FIELDS = ("memory", *(name for _, name, _ in TIME_GRID))


# ---------------------------------------------------------------------------------------------
# Metrics


# the one sign of every signed error `plan validate` prints (the by-nodes breakdown, `--per-row`, docs/planner.md)
SIGN_CONVENTION = "predicted / measured - 1: - = predicted faster than measured"


def signed_step_time_error(predicted_tok_s: float, measured_tok_s: float) -> float:
    """Predicted / measured step time - 1 from tokens/s at the same tokens per step (`SIGN_CONVENTION`)."""
    return measured_tok_s / predicted_tok_s - 1


def metrics(rows: list[Row], preds: list) -> dict:
    agree = sum((p.fits == r.ok) for r, p in zip(rows, preds, strict=True))
    mem_err = [abs(gib(p.peak_bytes) - r.mem_gib) / r.mem_gib for r, p in zip(rows, preds, strict=True)
               if r.ok and r.mem_gib > 0]
    false_fit = sum(p.fits and not r.ok for r, p in zip(rows, preds, strict=True))
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[r.group].append(i)
    rhos, regrets, regrets_ok, per_group = [], [], [], {}
    for g, idx in sorted(groups.items()):
        ok = [i for i in idx if rows[i].ok]
        entry: dict = {"rows": len(idx), "finished": len(ok)}
        if len(ok) >= 3:
            rho = spearman([preds[i].tokens_per_s_per_device for i in ok], [rows[i].tok_s_gpu for i in ok])
            rhos.append(rho)
            entry["spearman"] = round(rho, 3)
        if ok:
            best = max(rows[i].tok_s_gpu for i in ok)
            fit = [i for i in idx if preds[i].fits]
            if fit:
                pick = max(fit, key=lambda i: preds[i].tokens_per_s_per_device)
                regret = 1 - rows[pick].tok_s_gpu / best if rows[pick].ok else 1.0
                regrets.append(regret)
                entry["regret"] = round(regret, 4)
                entry["pick"] = rows[pick].layout.short()
            pick_ok = max(ok, key=lambda i: preds[i].tokens_per_s_per_device)
            regrets_ok.append(1 - rows[pick_ok].tok_s_gpu / best)
            entry["regret_among_finished"] = round(regrets_ok[-1], 4)
        per_group[f"{g[0]}/{g[1]}n" if isinstance(g[1], int) else f"{g[0]}/{g[1]}"] = entry
    timed = [(r.nodes, p.step_time_s, r.measured_step_time) for r, p in zip(rows, preds, strict=True)
             if r.ok and r.measured_step_time > 0]
    time_err = [abs(p / m - 1) for _, p, m in timed]
    by_nodes: dict[int, list[float]] = defaultdict(list)  # predicted / measured step time - 1, by job size
    for nodes, p, m in timed:
        by_nodes[nodes].append(p / m - 1)
    return {
        "rows": len(rows), "finished": sum(r.ok for r in rows),
        "median_step_time_error": statistics.median(time_err) if time_err else float("nan"),
        "step_time_spearman": spearman([p for _, p, _ in timed], [m for _, _, m in timed]) if len(timed) >= 3
        else float("nan"),
        "fits_agreement": agree / len(rows) if rows else float("nan"),
        "false_fit_rate": false_fit / len(rows) if rows else float("nan"),
        "median_memory_error": statistics.median(mem_err) if mem_err else float("nan"),
        "median_spearman": statistics.median(rhos) if rhos else float("nan"),
        "median_top1_regret": statistics.median(regrets) if regrets else float("nan"),
        "median_top1_regret_among_finished": statistics.median(regrets_ok) if regrets_ok else float("nan"),
        "groups": per_group,
        "step_time_error_by_nodes": {n: {"finished": len(e), "median_error": statistics.median(map(abs, e)),
                                         "median_signed": statistics.median(e)} for n, e in sorted(by_nodes.items())},
    }


def check_features(rows: list[Row]) -> dict[str, int]:
    """How many rows use each feature (`features` column; "rows": with any), every name checked: a feature is an
    input of the compute model (`planner/features.py`), not a reason to leave a row out."""
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        unknown = [f for f in r.features if f not in FEATURES]
        if unknown:
            raise CliError(f"--data: row of {r.model.name} on {r.nodes} node(s) has features {shown('+'.join(unknown))}"
                              f"; known features: {', '.join(FEATURES)} (joined with '+')")
        for f in r.features:
            counts[f] += 1
        counts["rows"] += bool(r.features)
    return dict(counts) if counts.get("rows") else {}


def row_framework(r: Row, fw: Framework, known: dict[str, Framework]) -> Framework:
    """The framework a row is modelled with: the profile's for the playbook's nanotron rows, else the row's own
    (a built-in one or a file of `planner/frameworks/`), with the row's features (`planner/features.py`)."""
    if r.framework == "nanotron" or r.framework == fw.name:
        return with_features(fw, r.features)
    if r.framework not in known:
        raise CliError(f"--data: framework = {shown(r.framework)} (a row of {r.model.name} on {r.nodes} "
                       f"node(s)) is not "
                          f"known; known frameworks: {', '.join(sorted(known))}")
    return with_features(known[r.framework], r.features)


def validate(rows: list[Row], fw: Framework, hw: Cluster, exact: bool = True) -> dict:
    known = all_frameworks()
    preds = [estimate(r.model, r.seq, r.layout, row_framework(r, fw, known), hw, exact) for r in rows]
    held_out = [r.held_out if r.held_out is not None else r.nodes not in FIT_NODES for r in rows]
    fitted = [i for i, h in enumerate(held_out) if not h]
    held = [i for i, h in enumerate(held_out) if h]
    held_records = [record(rows[i], preds[i]) for i in held]
    return {"fitted": metrics([rows[i] for i in fitted], [preds[i] for i in fitted]),
            "held_out": metrics([rows[i] for i in held], [preds[i] for i in held]),
            "gates": gates(held_records), "stalls": stall_counts(held_records),
            "stalls_fitted": stall_counts([record(rows[i], preds[i]) for i in fitted]),
            "rows": [row_record(r, p, h) for r, p, h in zip(rows, preds, held_out, strict=True)]}


def row_record(r: Row, p, held_out: bool | None) -> dict:
    """One row of `--per-row`: its prediction `p` beside its measurement (`held_out` None: a sweep's run, which
    nothing was fitted on)."""
    return {"model": r.model.name, "nodes": r.nodes, "layout": r.layout.short(), "seq": r.seq, "held_out": held_out,
            "fits": p.fits, "ran": r.ok, "predicted_tok_s_gpu": round(p.tokens_per_s_per_device, 1),
            "measured_tok_s_gpu": r.tok_s_gpu, "predicted_memory_gib": round(gib(p.peak_bytes), 3),
            "measured_memory_gib": r.mem_gib}


_LABELS = [("rows (finished)", None), ("fits/OOM agreement", "fits_agreement"),
           ("predicted fits but crashed", "false_fit_rate"), ("median memory error", "median_memory_error"),
           ("median step-time error", "median_step_time_error"),
           ("step-time Spearman (all rows)", "step_time_spearman"),
           ("median per-group Spearman", "median_spearman"), ("median top-1 regret", "median_top1_regret"),
           ("  (pick among finished rows)", "median_top1_regret_among_finished")]


def _cell(m: dict, key: str | None) -> str:
    if key is None:
        return f"{m['rows']} ({m['finished']})"
    if isinstance(m[key], float) and math.isnan(m[key]):
        return "-"
    if key in ("median_spearman", "step_time_spearman"):
        return f"{m[key]:.3f}"
    return f"{100 * m[key]:.1f} %"


def run_validate_results(args: argparse.Namespace) -> int:
    """`fivefold plan validate --results FILE`: the same figures on a sweep's own runs."""
    path = Path(args.results)
    rows, other_profiles = read_results(path, args.hardware)
    result = {"results": metrics(rows, [r.estimate for r in rows])}
    per_row = [row_record(r, r.estimate, None) for r in rows] if getattr(args, "per_row", False) else []
    if per_row:
        result["rows"] = per_row
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    profile = args.hardware or "the built-in profile of the device kind"
    engines = " and ".join(sorted({r.framework for r in rows})) or "fivefold"
    print(f"{path.name}: {len(rows)} runs that finished or ran out of memory, modelled as {engines} with {profile}")
    if other_profiles and not args.hardware:
        print(f"  (the sweep predicted with {', '.join(other_profiles)}: pass that profile as --hardware FILE to "
              "score it)")
    for label, key in _LABELS:
        print(f"{label:34s} {_cell(result['results'], key):>20s}")
    if per_row:  # a sweep's runs: processes on CPUs or GPUs, one per device
        print_per_row(per_row, "device")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    if getattr(args, "results", None):
        given = [flag for flag, on in (("--data", args.data), ("--fit", args.fit), ("--profile", args.profile),
                                       ("--out", getattr(args, "out", None)),
                                       ("--fit-fields", getattr(args, "fit_fields", None))) if on]
        if given:
            raise CliError(f"--results reads a sweep's store and predicts its runs with --hardware FILE; it does not "
                           f"combine with {', '.join(given)} (those fit and score a runs CSV): drop them")
        return run_validate_results(args)
    if not args.data and DEFAULT_DATA is None:
        raise CliError(f"fivefold plan validate needs the runs CSV: give --data FILE (the playbook's benchmark "
                          f"runs, {DATA_NAME}; a clone of the repository finds it in ../shared/data beside the "
                          "checkout, an installed package has no default)")
    if getattr(args, "out", None) is not None:
        if not args.fit:
            raise CliError(f"--out {shown(args.out)} writes the profile that --fit fits; add --fit")
        check_target(args.out, "--out", "fitted.toml")  # before the fit, which takes a while
    path = Path(args.data) if args.data else DEFAULT_DATA
    rows = read_runs_csv(path)
    with_features = check_features(rows)
    fw, hw = load_profile(Path(args.profile) if args.profile else None)
    by_split = any(r.held_out is not None for r in rows)
    fields = [f.strip() for f in (getattr(args, "fit_fields", "") or "").split(",") if f.strip()]
    if fields and not args.fit:
        raise CliError("--fit-fields chooses what --fit fits; add --fit")
    if [f for f in fields if f not in FIT_FIELDS] or (fields and fields != ["matmul_efficiency"]):
        raise CliError(f"--fit-fields {shown(','.join(fields))}: fit either everything (leave it out) or "
                          "matmul_efficiency alone (e.g. on one row marked split = fit)")
    train = [r for r in rows if (not r.held_out if r.held_out is not None else r.nodes in FIT_NODES)]
    noun = "row" if len(train) == 1 else "rows"
    where = f"{noun} with split = fit" if by_split else f"{noun} of 1-2 nodes"
    if args.fit and fields:
        hw = fit_matmul_efficiency(train, fw, hw)
        print(f"fitted on {len(train)} {where}: matmul_efficiency = {hw.matmul_efficiency}")
    elif args.fit:
        fw = fit_memory(train, fw)
        fw, hw = fit_time(train, fw, hw)
        hw = fit_stall(train, fw, hw)
        print(f"fitted on {len(train)} {where}: activation_scale = {fw.activation_scale}, logits_bytes = "
              f"{fw.logits_bytes}, fixed_overhead_gib = {fw.fixed_overhead_gib}, usable_memory_fraction = "
              f"{fw.usable_memory_fraction}, "
              + ", ".join(f"{name} = {getattr(fw if table == 'framework' else hw, name)}"
                          for table, name, _ in TIME_GRID) + f", inter_latency_us = {hw.inter_latency_us}, "
              + ", ".join(f"{name} = {getattr(hw, name)}" for name in STALL_FIELDS))
    if args.fit and getattr(args, "out", None):
        backup = keep_previous(args.out)
        if backup is not None:
            print(f"kept the previous {args.out} as {backup}")
        profile.write(args.out, fw, hw, hw.device if by_split else "h100-efa",
                      f"fitted by `fivefold plan validate --fit` on the {len(train)} {where} of {path.name}")
        print(f"wrote {args.out} (use it with: fivefold plan --hardware {args.out} ...)")
    result = validate(rows, fw, hw)
    result["features"] = with_features
    per_row = result.pop("rows")
    if getattr(args, "per_row", False):
        result["rows"] = per_row
    table = result.pop("gates")
    if args.json:
        print(json.dumps({**result, "gates": gates_json(table)}, indent=2))
        return 0
    frameworks = sorted({fw.name if r.framework in ("nanotron", fw.name) else r.framework for r in rows})
    nodes = "/".join(map(str, FIT_NODES))
    split = "by the file's split column" if by_split else f"constants fitted on nodes {nodes} only"
    print(f"{path.name}: {len(rows)} rows, modelled as {', '.join(frameworks)} on {hw.name}; {split}")
    if with_features:
        counts = dict(with_features)
        print(f"{counts.pop('rows')} row(s) modelled with their features: " + ", ".join(
            f"{FEATURES[f]} ({n})" for f, n in sorted(counts.items())))
    heads = ("fitted", "held out") if by_split else ("fitted (1-2 nodes)", "held out (4+ nodes)")
    print(f"{'':34s} {heads[0]:>20s} {heads[1]:>20s}")
    for label, key in _LABELS:
        cells = [_cell(m, key) for m in (result["fitted"], result["held_out"])]
        print(f"{label:34s} {cells[0]:>20s} {cells[1]:>20s}")
    by_nodes = {**result["fitted"]["step_time_error_by_nodes"], **result["held_out"]["step_time_error_by_nodes"]}
    if len(by_nodes) > 1:
        print(f"median step-time error by nodes (signed, {SIGN_CONVENTION}): " + ", ".join(
            f"{n}: {100 * e['median_error']:.1f} % ({100 * e['median_signed']:+.1f})"
            for n, e in sorted(by_nodes.items())))
    if not by_split:
        print_gates(table, result, hw)
    if getattr(args, "per_row", False):
        print_per_row(per_row)
    return 0


# ---------------------------------------------------------------------------------------------
# The stall model and the gates (`tools/gates.py`)


def fit_stall(rows: list[Row], fw: Framework, hw: Cluster) -> Cluster:
    """The cluster's risk fitted on `rows` (the 1-2-node rows): each finished pipelined row stalled or not by the
    rule fixed on them (`gates.is_stalled`); the per-node hazard h by maximum likelihood (a row of n nodes stalls
    with chance 1 - (1 - h)^n); the seconds per stalled hand-over by least squares on their log, one level at
    pp = 2 and one at pp > 2, growing by a factor per doubling of tp; and the drift per doubling of the nodes from
    the clean rows (the slope of the median log of measured / predicted over log2 nodes, none below 0: more nodes
    do not make a collective faster)."""
    import numpy as np

    hw = dataclasses.replace(hw, stall_hazard_per_node=0.0, drift_per_node_doubling=0.0)
    known = all_frameworks()
    ok = [r for r in rows if r.ok and r.measured_step_time > 0]
    records = [record(r, estimate(r.model, r.seq, r.layout, row_framework(r, fw, known), hw, True)) for r in ok]
    piped = [(r, x) for r, x in zip(ok, records, strict=True) if x.handovers]
    stalled = [(r, x) for r, x in piped if is_stalled(x)]
    if not stalled:
        return hw
    hazards = [i / 10000 for i in range(1, 5000)]
    hazard = max(hazards, key=lambda h: sum(math.log(1 - (1 - h) ** r.nodes) if is_stalled(x)
                                            else r.nodes * math.log(1 - h) for r, x in piped))
    deep = any(r.layout.pp > 2 for r, _ in stalled) and any(r.layout.pp == 2 for r, _ in stalled)
    columns = [0, 1, 2] if deep else [0, 2]  # level, the offset at pp > 2, log2 tp
    design = np.array([[1.0, float(r.layout.pp > 2), math.log2(r.layout.tp)] for r, _ in stalled])[:, columns]
    target = np.log([(x.measured_s - x.clean_s) / x.handovers for _, x in stalled])
    coef = np.linalg.lstsq(design, target, rcond=None)[0]
    clean = [(r, x) for r, x in zip(ok, records, strict=True) if not is_stalled(x)]
    by_nodes = {n: statistics.median(math.log(x.measured_s / x.clean_s) for r, x in clean if r.nodes == n)
                for n in sorted({r.nodes for r, _ in clean})}
    drift = 0.0
    if len(by_nodes) > 1:
        slope = np.polyfit([math.log2(n) for n in by_nodes], list(by_nodes.values()), 1)[0]
        drift = max(0.0, math.exp(slope) - 1)
    return dataclasses.replace(
        hw, stall_hazard_per_node=hazard, stall_s_per_handover=round(math.exp(coef[0]), 3),
        stall_s_per_handover_deep=round(math.exp(coef[0] + coef[1]), 3) if deep else 0.0,
        stall_growth_per_tp_doubling=round(math.exp(coef[-1]) - 1, 3), drift_per_node_doubling=round(drift, 3))


def record(r: Row, p) -> Record:
    """A row and its estimate as the gates see them (`gates.Record`)."""
    clean = p.step_time_s
    return Record(r.nodes, r.group, r.ok, p.fits, handovers(r.layout), clean, clean + p.stall.added_s,
                  p.stall.probability, r.measured_step_time if r.ok else 0.0,
                  p.tokens_per_s_per_device * p.step_time_s)


def gates_json(table: list) -> list[dict]:
    return [{"gate": g.label, "holds": g.all_hold,
             "by_nodes": {n: {"figure": f, "bound": b, "holds": g.holds(f, b)} for n, (f, b) in g.by_nodes.items()},
             **({"all_held_out": {"figure": g.overall[0], "bound": g.overall[1],
                                  "holds": g.holds(*g.overall)}} if g.overall else {})} for g in table]


STALL_FIELDS = ("stall_hazard_per_node", "stall_s_per_handover", "stall_s_per_handover_deep",
                "stall_growth_per_tp_doubling", "drift_per_node_doubling")


def print_gates(table: list, result: dict, hw: Cluster) -> None:
    """The gates by node count, the stall counts behind them, and when each rule was fixed."""
    print(f"\nstall model ({hw.name}, fitted on the 1-2-node rows): " + ", ".join(
        f"{name} = {getattr(hw, name)}" for name in STALL_FIELDS))
    counts = {**result["stalls_fitted"], **result["stalls"]}
    print("stalled / pipelined finished runs (predicted rate): " + ", ".join(
        f"{n}: {s}/{m} ({p:.2f})" for n, (s, m, p) in sorted(counts.items()) if m))
    print(f"gates on the held-out rows ({SIGN_CONVENTION}):")
    for line in format_gates(table):
        print(line)
    failing = [g.label for g in table if not g.all_hold]
    print(f"{len(table) - len(failing)} of {len(table)} gates hold" + (f"; failing: {'; '.join(failing)}"
                                                                      if failing else ""))
    print("when the rules were fixed: before the held-out rows were scored, on the 1-2-node rows: the stall rule "
          "(0.1 s per hand-over above the clean time), the p50 as a run's point prediction, the per-node hazard, the "
          "stall time's form (pp = 2 / pp > 2, per doubling of tp), the drift per doubling of the nodes, the rank "
          "rule (expected time) of the regret's pick; after: the Spearman gate ranks by the p50 (first run: by the "
          "expected time, 0.699 held out), and the per-node hazard was kept once the held-out stall rates had been "
          "seen (docs/planner.md, \"Issue 32: the stall-aware model and its gates\")")


def _split(held_out: bool | None) -> str:
    """A row's split column: fitted, held out, or "-" (a sweep's run: nothing is fitted on those)."""
    return "-" if held_out is None else "held out" if held_out else "fitted"


def print_per_row(per_row: list[dict], unit: str = "GPU") -> None:
    """`--per-row`: every row's prediction beside its measurement, tokens/s per `unit` (GPU: the published runs;
    device: a sweep's, whose processes may run on CPUs)."""
    print(f"\nevery row; error: the step time's, {SIGN_CONVENTION} (from tokens/s: measured / predicted - 1)")
    pred = f"tok/s/{unit} pred"
    width = max(14, len(pred))
    print(f"{'model':14s} {'nodes':>5s} {'layout':38s} {'seq':>7s} {'split':>8s} {pred:>{width}s} "
          f"{'measured':>9s} {'error':>7s} {'GiB pred':>8s} {'measured':>8s}")
    # small runs (a sweep's on a CPU) in MiB-sized steps: one decimal of a GiB would read 0.0 against 0.1
    digits = 1 if max((max(r["predicted_memory_gib"], r["measured_memory_gib"]) for r in per_row), default=0) >= 10 \
        else 3
    for r in per_row:
        err = (f"{100 * signed_step_time_error(r['predicted_tok_s_gpu'], r['measured_tok_s_gpu']):+.0f} %"
               if r["measured_tok_s_gpu"] and r["predicted_tok_s_gpu"] else "-")
        fits = "" if r["fits"] == r["ran"] else (" (predicted OOM)" if r["ran"] else " (predicted to fit)")
        print(f"{r['model']:14s} {r['nodes']:5d} {r['layout']:38s} {r['seq']:7d} "
              f"{_split(r['held_out']):>8s} {r['predicted_tok_s_gpu']:{width},.0f} "
              f"{r['measured_tok_s_gpu']:9,.0f} {err:>7s} {r['predicted_memory_gib']:8.{digits}f} "
              f"{r['measured_memory_gib']:8.{digits}f}{fits}")
