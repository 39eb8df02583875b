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

`load_grid` checks what `expand` computes with before any combination is built: the counts of the layout and
the batch (`COUNTS`: integers in their range), no value twice in one axis, and the fields that a run does not use
(`UNUSED`: refused where they vary, a note where they are fixed), and no value that no run can time
(`UNTIMEABLE`: a document mask). `expand` builds every combination's full
`Config`, validates it with the config's and the layout validator's rules (an invalid one keeps the validator's
message), and gives each a stable key: a hash of the normalised config and the measurement protocol (steps,
warm-up), and a label that holds every field the grid varies.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.config import (
    MAX_TIMED_STEPS,
    Config,
    ConfigError,
    DataConfig,
    LayoutConfig,
    LogConfig,
    build_config,
    did_you_mean,
    load_file,
    shown,
)
from fivefold.flops import balanced_stage_layers
from fivefold.layout import check_layout, n_stages

SECTIONS = ("model", "layout", "train", "data", "log")
TOP_KEYS = {"name": str, "steps": int, "warmup": int, "timeout": (int, float), "devices": (int, list)}
# fields that do not change what a timed run measures, left out of the run key
_KEYLESS = {"run_dir": None, "log": None, "data": None,
            "train": ("max_steps", "warmup_steps", "eval_every", "eval_batches", "checkpoint_every",
                      "keep_checkpoints")}
_PARALLEL = "ranks of a parallel dimension"
# the grid's integer fields that `expand` computes with (the device count, dp, the micro-batch and accumulation):
# (lowest value, what the field counts), checked on the grid's own values before any combination is built
COUNTS: dict[str, tuple[int, str]] = {
    **{f"layout.{name}": (1, _PARALLEL) for name in ("dp", "tp", "pp", "cp", "ep", "etp", "vpp")},
    "layout.micro_batch_size": (0, "sequences per micro-batch per rank; 0 = the whole per-rank batch"),
    "train.global_batch_size": (1, "sequences per step"),
    "train.seq_len": (1, "tokens per sequence"),
}
_NO_LOG = "a sweep's run (fivefold bench) writes no training log, progress, profile or tracker run"
# fields of a config that a sweep's run (`fivefold bench` for warmup + steps steps on random tokens) does not use,
# and why: refused where the grid varies them (the runs would differ in nothing measured), a note where fixed
UNUSED: dict[str, str] = {
    "train.max_steps": "a sweep's run takes the grid's warmup + steps steps (its top-level steps and warmup)",
    "train.warmup_steps": "a sweep's run times a few steps at the constant learning rate, without a warm-up",
    "train.eval_every": "a sweep's run does not evaluate",
    "train.eval_batches": "a sweep's run does not evaluate",
    "train.checkpoint_every": "a sweep's run writes no checkpoint",
    "train.keep_checkpoints": "a sweep's run writes no checkpoint",
    **{f"data.{f.name}": "a sweep's run (fivefold bench) trains on random tokens, not on a data set"
       for f in dataclasses.fields(DataConfig)},
    **{f"log.{f.name}": _NO_LOG for f in dataclasses.fields(LogConfig) if f.name != "peak_tflops"},
}
# fields a run uses that its key leaves out: a fixed value is fine, varying it gives runs that measure the same
_SAME_RUN = {"log.peak_tflops": "it only sets the peak that the MFU is computed against, the run measured is the same"}


@dataclass
class Grid:
    name: str
    steps: int
    warmup: int
    timeout: float
    products: list[dict[str, Any]]  # each: {"devices": [..] or None, "model": {...}, "layout": {...}, ...}
    notes: list[str] = field(default_factory=list)  # one line per field of the grid that the runs do not use


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
        return batch_shape(self.cfg)[0]

    @property
    def grad_accum_steps(self) -> int:
        return batch_shape(self.cfg)[1]


def batch_shape(cfg: Config) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) of `cfg`, as `Config` computes them, but 0 instead of a division by
    zero where the global batch is smaller than dp (an invalid run, whose label and row still show it)."""
    mbs = cfg.layout.micro_batch_size or cfg.train.global_batch_size // cfg.layout.dp
    per_step = cfg.layout.dp * mbs
    return mbs, cfg.train.global_batch_size // per_step if per_step > 0 else 0


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
            raise ConfigError(f"grid key {shown(key)} is not known{did_you_mean(key, [*TOP_KEYS, *SECTIONS])}; "
                              f"top-level keys: {', '.join(TOP_KEYS)}, sections: "
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
                raise ConfigError(f"[[grid]] entry {i + 1}: key {shown(key)} is not known"
                                  f"{did_you_mean(key, [*SECTIONS, 'devices'])}; use devices or the sections "
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
            if isinstance(devices, list) and len(set(devices)) < len(devices):
                raise ConfigError(f"grid devices = {shown(devices)} lists a value more than once; give each device "
                                  "count once (a repeated value is the same run again)")
    check_grid_size(products, timeout)
    for product in products:
        check_counts(product)
        check_repeats(product)
        check_timeable(product)
    return Grid(name, steps, warmup, timeout, products, unused_fields(products))


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


def _values(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def check_counts(product: dict) -> None:
    """Each value the grid gives a field of `COUNTS` (the counts `expand` divides and multiplies by) is an integer
    of at least its lowest value: one line naming the field, the value and the rule if not."""
    for dotted, (low, what) in COUNTS.items():
        section, name = dotted.split(".")
        value = (product.get(section) or {}).get(name)
        if value is None:
            continue
        for v in _values(value):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                within = f" (in {dotted} = {shown(value)})" if isinstance(value, list) else ""
                raise ConfigError(f"grid {dotted} = {shown(v)}{within} must be an integer >= {low} ({what})")


def check_repeats(product: dict) -> None:
    """No axis is empty or lists one value twice (the same combination again would be the same run, silently
    dropped)."""
    for section in SECTIONS:
        for name, value in (product.get(section) or {}).items():
            if not isinstance(value, list):
                continue
            if not value:
                raise ConfigError(f"grid {section}.{name} = [] is empty; give at least one value")
            for i, v in enumerate(value):
                if v in value[:i]:
                    raise ConfigError(f"grid {section}.{name} = {shown(value)} lists {shown(v)} more than once; give "
                                      "each value of an axis once (a repeated value is the same run again)")


# values of a field that a sweep's run (`fivefold bench`, on random tokens) refuses when it starts, and why: refused
# when the grid is read, instead of recording every such run as a crash
UNTIMEABLE: dict[str, tuple[Any, str]] = {
    "model.attn_mask": ("document", "a sweep's run (fivefold bench) trains on random tokens, which hold no document "
                                    "boundaries, so it cannot time document masking (benchmarks/document_mask.py "
                                    "times it on packed documents, `fivefold plan --doc-len N` prices it); give "
                                    "model.attn_mask = 'causal' or leave it out"),
}


def check_timeable(product: dict) -> None:
    """No value of the grid is one that every run given it would fail on (`UNTIMEABLE`): one line naming the field,
    the value and why."""
    for dotted, (bad, why) in UNTIMEABLE.items():
        section, name = dotted.split(".")
        value = (product.get(section) or {}).get(name)
        if value is not None and bad in _values(value):
            within = f" (in {dotted} = {shown(value)})" if isinstance(value, list) else ""
            raise ConfigError(f"grid {dotted} = {shown(bad)}{within} cannot be swept: {why}")


def _identity(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def varying_fields(products: list[dict]) -> list[str]:
    """The dotted fields (in file order) that take more than one value over the whole grid: an axis of two values
    or more, or a field whose value differs between `[[grid]]` tables (or that some of them set and others not)."""
    values: dict[str, set[str]] = {}
    present: dict[str, int] = {}
    for product in products:
        for section in SECTIONS:
            for name, value in (product.get(section) or {}).items():
                key = f"{section}.{name}"
                values.setdefault(key, set()).update(_identity(v) for v in _values(value))
                present[key] = present.get(key, 0) + 1
    return [k for k, seen in values.items() if len(seen) > 1 or present[k] < len(products)]


def unused_fields(products: list[dict]) -> list[str]:
    """Refuse a field of `UNUSED` or `_SAME_RUN` that the grid varies (one line naming it, its values and why);
    return one note for each field of `UNUSED` that the grid sets to one value."""
    varying = set(varying_fields(products))
    notes: dict[str, str] = {}
    for product in products:
        for section in SECTIONS:
            for name, value in (product.get(section) or {}).items():
                key = f"{section}.{name}"
                why = UNUSED.get(key) or _SAME_RUN.get(key)
                if why is None:
                    continue
                if key in varying:
                    raise ConfigError(f"grid {key} = {shown(value)} varies, but {why}: the runs would differ in "
                                      f"nothing they measure; give {key} one value or leave it out")
                if key in UNUSED:
                    notes.setdefault(key, f"grid {key} = {shown(value)} is ignored: {why}")
    return list(notes.values())


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


def _whole_batch(cfg: Config) -> int | None:
    la, gbs = cfg.layout, cfg.train.global_batch_size
    return gbs // la.dp if la.dp >= 1 and gbs % la.dp == 0 else None


def _head_dim(cfg: Config) -> int | None:
    m = cfg.model
    return m.hidden // m.n_heads if m.n_heads >= 1 and m.hidden % m.n_heads == 0 else None


def _balanced_stages(cfg: Config) -> list[int] | None:
    """The compute-balanced split that an empty `layout.stage_layers` means (`pipeline.stage_layer_counts`), where
    an explicit split can be given at all: pp > 1, every stage at least one block."""
    la, m = cfg.layout, cfg.model
    stages = n_stages(la)
    if la.pp == 1 or not 1 <= stages <= m.n_layers:
        return None
    return balanced_stage_layers(m, stages, cfg.train.seq_len)


def _unset(cfg: Config, name: str) -> LayoutConfig:
    """`cfg.layout` with the field `name` left out (null), to read what the engine resolves null to."""
    return dataclasses.replace(cfg.layout, **{name: None})


def _dtype_on_device(cfg: Config) -> str:
    """`train.dtype`, with "auto" on a named device written as what it resolves to there (`device.use_bf16`): bf16
    on an accelerator, fp32 on the CPU. Under `train.device = "auto"` it is kept: its meaning depends on the machine
    that runs it."""
    t = cfg.train
    if t.dtype != "auto" or t.device == "auto":
        return t.dtype
    return "fp32" if t.device.split(":", 1)[0] == "cpu" else "bf16"


def _as_default(name: str, resolve: Callable[[Config], Any]) -> Callable[[Config], Any]:
    """The canonical spelling of the field `name` (section.field) whose default (0, null, []) the engine resolves
    to `resolve(cfg)`: the default where the value given is what the default resolves to, else the value given.
    `resolve` returns None where no explicit value is the same run (it would be refused, or it is another run)."""
    section, field_name = name.split(".")
    default = getattr(getattr(Config(), section), field_name)

    def canonical(cfg: Config) -> Any:
        value = getattr(getattr(cfg, section), field_name)
        if value == default:
            return value
        derived = resolve(cfg)
        # the type too: a bool is not the integer 1
        if derived is None or type(value) is not type(derived) or value != derived:
            return value
        # and never an explicit value that a validator refuses, where the default is not (e.g. tp_comm_overlap =
        # true under float8): a refused run and a run are two
        spelled = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                           **{field_name: default})})
        return default if _runs(cfg) == _runs(spelled) else value

    return canonical


def _runs(cfg: Config) -> bool:
    """Whether `expand` finds `cfg` valid (`Config.validate` and the layout validator on its world size)."""
    try:
        cfg.validate()
        check_layout(cfg, cfg.layout.world_size)
    except ConfigError:
        return False
    return True


# One run, spelled two ways, hashed once (`run_key`): each field whose default (0, null, "auto", an empty list) the
# engine resolves from the rest of the config, and its canonical spelling in a config. The default is canonical
# (the spelling of every grid that leaves the field out), but for train.dtype, whose explicit fp32 / bf16 is what
# grids name (examples/sweep-cpu.toml). Each reads only fields outside this table, or their resolved values
# (`expert_ffn`, `head_dim`), so the order does not matter. Keyed as spelled, deliberately:
#   train.threads (0 = this machine's cores / its local processes), train.device ("auto" = this machine's
#     accelerator) and train.dtype under device "auto": what they resolve to depends on the machine. A run key
#     names what is measured, never the machine (the store's host and device columns say where it ran), and under
#     --slurm it is computed on the submitting host, whose cores and devices are not the compute nodes'; so threads
#     = 0 and threads = 8 are two runs even where 0 means 8
#   layout.dp_shard (0 = ZeRO-3 over all of dp x cp): dp_shard = dp, which would mean the same, is refused (HSDP
#     needs dp_shard < dp)
#   model.sliding_window (null = no window): a window as long as the sequence sees the same tokens but runs the
#     windowed kernels (`ModelConfig.masks_attention`): another run
#   model.capacity_factor, router_z_loss_coef, bias_update_rate (0 = dropless, off, off): no other value means it
_CANONICAL: dict[str, Callable[[Config], Any]] = {
    # 0 = the whole per-rank batch, global_batch_size / dp
    "layout.micro_batch_size": _as_default("layout.micro_batch_size", _whole_batch),
    "model.moe_ffn": _as_default("model.moe_ffn", lambda cfg: cfg.model.ffn),  # 0 = ffn (`expert_ffn`)
    "model.head_size": _as_default("model.head_size", _head_dim),  # null = hidden / n_heads (`head_dim`)
    "layout.stage_layers": _as_default("layout.stage_layers", _balanced_stages),  # [] = balanced by compute
    # null = Megatron's rule (`LayoutConfig.dp_bucket_elements`); a size is refused under ZeRO-3, which has no buckets
    "layout.dp_bucket_size": _as_default("layout.dp_bucket_size", lambda cfg: (
        _unset(cfg, "dp_bucket_size").dp_bucket_elements if cfg.layout.zero < 3 else None)),
    # null = on wherever the overlap applies, off elsewhere: so true where it applies, false where it does not (true
    # where it does not is refused)
    **{f"layout.{name}": _as_default(f"layout.{name}", lambda cfg, name=name, prop=prop: getattr(
        _unset(cfg, name), prop)) for name, prop in (("dp_overlap_param_gather", "overlaps_param_gather"),
                                                     ("pp_comm_overlap", "overlaps_pp_comm"),
                                                     ("pp_fb_overlap", "overlaps_fb"),
                                                     ("tp_comm_overlap", "overlaps_tp_comm"))},
    "train.dtype": _dtype_on_device,  # "auto" = bf16 on an accelerator, fp32 on the CPU
}


def canonical_spelling(cfg: Config) -> dict[str, Any]:
    """`cfg.to_dict()` with each field of `_CANONICAL` in its canonical spelling (e.g. `model.moe_ffn = ffn` as 0,
    the default that means it), so that two spellings of one run are one dict."""
    data = cfg.to_dict()
    for dotted, canonical in _CANONICAL.items():
        section, name = dotted.split(".")
        data[section][name] = canonical(cfg)
    return data


def run_key(cfg: Config, steps: int, warmup: int) -> str:
    """A stable hash of what a run measures: the config without paths and logging, and the protocol. A field given
    the value that its default (0, null, []) resolves to in this config (`_CANONICAL`: e.g. a micro-batch of the
    whole per-rank batch, `model.moe_ffn = ffn`) is hashed as the default, and `train.dtype = "auto"` on a named
    device as the dtype it resolves to, so that both spellings of the one run share its key; every other config
    hashes as it always has."""
    data = canonical_spelling(cfg)
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
    mbs, ga = batch_shape(cfg)
    s = f"dp{la.dp} tp{la.tp}{'+sp' if la.sp else ''}"
    for name in ("pp", "cp", "ep"):
        if getattr(la, name) > 1:
            s += f" {name}{getattr(la, name)}"
    s += f" z{la.zero} mbs{mbs} ga{ga} rc:{la.recompute}"
    if la.pp > 1:
        s += f" {la.schedule}" + (f" v{la.vpp}" if la.vpp > 1 else "")
    return s


# the fields that `layout_label` always shows a change of (pp, cp and ep show every value but 1; the global batch
# is dp x micro-batch x accumulation); schedule and vpp it shows where pp > 1
_IN_LAYOUT_LABEL = {f"layout.{n}" for n in ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch_size", "recompute",
                                            "sp")} | {"train.global_batch_size"}


def _shown_by_layout(key: str, cfg: Config) -> bool:
    return key in _IN_LAYOUT_LABEL or (key in ("layout.schedule", "layout.vpp") and cfg.layout.pp > 1)


def _value(cfg: Config, key: str, overrides: dict[str, Any]) -> Any:
    section, name = key.split(".", 1)
    if key == "model.preset":  # not a field of the model: the grid's value
        return overrides.get(key, "-")
    return getattr(getattr(cfg, section), name)


def expand(grid: Grid) -> tuple[list[PlannedRun], dict[str, int]]:
    """Every run of the grid (deduplicated by key, in grid order) and the count of combinations dropped
    because their layout does not fill a device count, by reason."""
    runs: dict[str, PlannedRun] = {}
    dropped: dict[str, int] = {}
    varying = varying_fields(grid.products)
    # the model's name shows the preset unless the grid names the model itself
    named = any("name" in (p.get("model") or {}) for p in grid.products)
    model_fields = [k for k in varying if k.startswith("model.") and (k != "model.preset" or named)]
    other_fields = [k for k in varying if not k.startswith("model.")]
    for product in grid.products:
        axes = _axes(product)
        devices = product.get("devices")
        device_list = devices if isinstance(devices, list) else [devices]
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
                model = cfg.model.name + "".join(f" {k.split('.', 1)[1]}={_value(cfg, k, overrides)}"
                                                 for k in model_fields)
                key = run_key(cfg, grid.steps, grid.warmup)
                # every other field the grid varies that the layout's name does not show, e.g. `seq_len=64`
                extra = "".join(f" {k.split('.', 1)[1]}={_value(cfg, k, overrides)}" for k in other_fields
                                if not _shown_by_layout(k, cfg))
                label = f"{model} | {layout_label(cfg)}{extra}"
                runs.setdefault(key, PlannedRun(cfg, key, label, model, cfg.layout.world_size, invalid))
    return list(runs.values()), dropped


def config_json(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)
