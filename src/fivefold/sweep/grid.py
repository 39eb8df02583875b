"""A sweep grid: a TOML file whose sections are those of a fivefold config, where a list is an axis.

    name = "cpu"                 # label of the sweep (default: the file's stem)
    steps = 5                    # timed steps per run
    warmup = 2                   # untimed steps before them
    timeout = 300                # seconds per run (--timeout overrides)
    devices = [1, 2, 4]          # optional: device counts; layout.dp fills devices / (tp x pp x cp)

    [model]
    preset = ["tiny", "tiny-moe"]       # an axis of presets; any model field may be an axis too

    [layout]
    tp = [1, 2]
    zero = [0, 1]

    [train]
    seq_len = 128
    global_batch_size = 16

    [[grid]]                     # optional: more products, each merged over the top level; the union runs
    devices = [2]
    layout = { recompute = ["none", "selective", "full"] }

`expand` builds every combination's full `Config`, validates it with the config's and the layout validator's
rules (an invalid one keeps the validator's message), and gives each a stable key: a hash of the normalised
config and the measurement protocol (steps, warm-up).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.config import MAX_TIMED_STEPS, Config, ConfigError, build_config, load_file, shown
from fivefold.layout import check_layout

SECTIONS = ("model", "layout", "train", "data", "log")
TOP_KEYS = {"name": str, "steps": int, "warmup": int, "timeout": (int, float), "devices": (int, list)}
# fields that do not change what a timed run measures, left out of the run key
_KEYLESS = {"run_dir": None, "log": None, "data": None,
            "train": ("max_steps", "warmup_steps", "eval_every", "eval_batches", "checkpoint_every",
                      "keep_checkpoints")}


@dataclass
class Grid:
    name: str
    steps: int
    warmup: int
    timeout: float
    products: list[dict[str, Any]]  # each: {"devices": [..] or None, "model": {...}, "layout": {...}, ...}


@dataclass
class PlannedRun:
    """One combination of the grid: its config, key and label, and why it cannot run (None if it can)."""

    cfg: Config
    key: str
    label: str
    model: str
    n_devices: int
    invalid: str | None = None

    @property
    def micro_batch_size(self) -> int:
        return self.cfg.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.cfg.grad_accum_steps


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file; errors name the key and what is allowed."""
    path = Path(path)
    data = load_file(path, "grid file")
    top = {k: v for k, v in data.items() if k != "grid"}
    for key, value in top.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"grid [{key}] must be a table of config fields, got {shown(value)}")
        elif key not in TOP_KEYS:
            raise ConfigError(f"grid key {shown(key)} is not known; top-level keys: {', '.join(TOP_KEYS)}, sections: "
                              f"{', '.join(SECTIONS)}, and [[grid]] tables")
        elif not isinstance(value, TOP_KEYS[key]) or isinstance(value, bool):
            raise ConfigError(f"grid {key} = {shown(value)} has the wrong type")
    name = str(top.get("name", path.stem))
    if not name or re.search(r"[\x00-\x1f\x7f]", name):
        raise ConfigError(f"grid name = {shown(name)} must be non-empty and hold no control characters (newline, tab, "
                          "...): it names SLURM jobs and reports; e.g. name = \"cpu-sweep\"")
    steps, warmup = int(top.get("steps", 5)), int(top.get("warmup", 2))
    if not 1 <= steps <= MAX_TIMED_STEPS or not 0 <= warmup <= MAX_TIMED_STEPS:
        raise ConfigError(f"grid steps = {steps} must be between 1 and {MAX_TIMED_STEPS:,} and warmup = {warmup} "
                          f"between 0 and {MAX_TIMED_STEPS:,} (a sweep times a few steps of each layout)")
    timeout = float(top.get("timeout", 600))
    if not math.isfinite(timeout) or timeout <= 0:
        raise ConfigError(f"grid timeout = {timeout} must be > 0 seconds")
    base = {k: v for k, v in top.items() if k in SECTIONS or k == "devices"}
    extra = data.get("grid", [])
    if not isinstance(extra, list) or not all(isinstance(e, dict) for e in extra):
        raise ConfigError("grid [[grid]] entries must be tables (write them as [[grid]] sections)")
    products = []
    for i, entry in enumerate(extra or [{}]):
        for key in entry:
            if key not in SECTIONS and key != "devices":
                raise ConfigError(f"[[grid]] entry {i + 1}: key {shown(key)} is not known; use devices or the sections "
                                  f"{', '.join(SECTIONS)}")
            if key in SECTIONS and not isinstance(entry[key], dict):
                raise ConfigError(f"[[grid]] entry {i + 1}: {key} = {shown(entry[key])} must be a table of config "
                                  "fields")
        products.append(_merge(base, entry))
    for product in products:
        devices = product.get("devices")
        if devices is not None:
            values = devices if isinstance(devices, list) else [devices]
            if not values or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in values):
                raise ConfigError(f"grid devices = {shown(devices)} must be a positive integer or a list of them")
    check_grid_size(products, timeout)
    return Grid(name, steps, warmup, timeout, products)


MAX_GRID_POINTS = 10_000  # combinations of one sweep: at a minute each, a week of runs


def check_grid_size(products: list[dict], timeout: float) -> None:
    """Refuse a grid of more than MAX_GRID_POINTS combinations, counted from its axes before any is expanded."""
    points = 0
    for product in products:
        devices = product.get("devices")
        points += len(devices if isinstance(devices, list) else [devices]) * math.prod(
            len(v) if isinstance(v, list) else 1 for section in SECTIONS
            for v in (product.get(section) or {}).values())
    if points > MAX_GRID_POINTS:
        raise ConfigError(f"the grid has {points:,} combinations of its axes; a sweep runs at most "
                          f"{MAX_GRID_POINTS:,} (up to {points * timeout / 3600:,.0f} hours at its timeout of "
                          f"{timeout:g} s each); split it into smaller grids or give fewer values per axis")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _axes(product: dict) -> list[tuple[str, list]]:
    """(dotted key, values) of every field, in file order; a scalar is an axis of one value."""
    out = []
    for section in SECTIONS:
        for key, value in product.get(section, {}).items():
            values = value if isinstance(value, list) else [value]
            if not values:
                raise ConfigError(f"grid {section}.{key} = [] is empty; give at least one value")
            out.append((f"{section}.{key}", values))
    return out


def run_key(cfg: Config, steps: int, warmup: int) -> str:
    """A stable hash of what a run measures: the config without paths and logging, and the protocol."""
    data = cfg.to_dict()
    for section, fields in _KEYLESS.items():
        if fields is None:
            data.pop(section, None)
        else:
            for f in fields:
                data[section].pop(f, None)
    text = json.dumps({"config": data, "steps": steps, "warmup": warmup}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layout_label(cfg: Config) -> str:
    """A short name of the layout, e.g. `dp2 tp2+sp z1 mbs4 ga2 rc:full`."""
    la = cfg.layout
    s = f"dp{la.dp} tp{la.tp}{'+sp' if la.sp else ''}"
    for name in ("pp", "cp", "ep"):
        if getattr(la, name) > 1:
            s += f" {name}{getattr(la, name)}"
    s += f" z{la.zero} mbs{cfg.micro_batch_size} ga{cfg.grad_accum_steps} rc:{la.recompute}"
    if la.pp > 1:
        s += f" {la.schedule}" + (f" v{la.vpp}" if la.vpp > 1 else "")
    return s


def expand(grid: Grid) -> tuple[list[PlannedRun], dict[str, int]]:
    """Every run of the grid (deduplicated by key, in grid order) and the count of combinations dropped
    because their layout does not fill a device count, by reason."""
    runs: dict[str, PlannedRun] = {}
    dropped: dict[str, int] = {}
    for product in grid.products:
        axes = _axes(product)
        devices = product.get("devices")
        device_list = devices if isinstance(devices, list) else [devices]
        varying = [k for k, v in axes if len(v) > 1 and k.startswith("model.") and k != "model.preset"]
        for n in device_list:
            for values in itertools.product(*(v for _, v in axes)):
                overrides = dict(zip((k for k, _ in axes), values, strict=True))
                cfg = build_config(None, overrides)  # unknown fields and wrong types stop the sweep here
                if n is not None:
                    per_dp = cfg.layout.tp * cfg.layout.pp * cfg.layout.cp
                    if "layout.dp" not in overrides:
                        if n % per_dp:
                            reason = f"tp x pp x cp does not divide {n} devices"
                            dropped[reason] = dropped.get(reason, 0) + 1
                            continue
                        cfg.layout.dp = n // per_dp
                    elif cfg.layout.world_size != n:
                        reason = f"dp x tp x pp x cp is not {n} devices"
                        dropped[reason] = dropped.get(reason, 0) + 1
                        continue
                cfg.train.max_steps = grid.warmup + grid.steps
                cfg.train.warmup_steps = 0
                cfg.run_dir = ""
                invalid = None
                try:
                    if cfg.train.seq_len > cfg.model.max_seq_len:
                        cfg.model.max_seq_len = cfg.train.seq_len  # the run's own context, as bench does
                    cfg.validate()
                    check_layout(cfg, cfg.layout.world_size)
                except ConfigError as e:
                    invalid = str(e)
                model = cfg.model.name + "".join(f" {k.split('.', 1)[1]}={overrides[k]}" for k in varying)
                key = run_key(cfg, grid.steps, grid.warmup)
                label = f"{model} | {layout_label(cfg)}"
                runs.setdefault(key, PlannedRun(cfg, key, label, model, cfg.layout.world_size, invalid))
    return list(runs.values()), dropped


def config_json(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)
