"""One profile format for `fivefold plan`, `plan validate` and `fivefold calibrate`.

A profile is a TOML file of hardware fields (`fivefold.planner.hardware.Cluster`, at the top level as
`calibrate` writes them, or under a `[hardware]` table as `plan validate --fit --out` writes them; `base` names
the preset they override) and optionally a `[framework]` table: `name` (a framework the planner knows) plus any
field of `fivefold.planner.layout.Framework` to override (the fitted memory and overlap constants). Every
command reads every profile: the hardware part with `get_cluster`, the framework part with `framework_of`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fivefold.config import ConfigError, did_you_mean, load_file, shown, write_text_atomic
from fivefold.planner.hardware import Cluster, Range, checked_number, get_cluster
from fivefold.planner.kernels import all_devices
from fivefold.planner.layout import FRAMEWORKS, Framework
from fivefold.planner.time import ELEMENTWISE_CLASSES


def _read(path: str | Path) -> dict:
    return load_file(path, "--hardware", suffix=".toml")


FRAMEWORK_DIR = Path(__file__).resolve().parent / "frameworks"
# [framework] words and the values each takes, with what they mean where a refusal says it
_FRAMEWORK_CHOICES = {
    "compute_dtype": (("bf16", "fp32"), ""),
    "stage_split": (("balanced", "params"),
                    "balanced: by FLOPs, at least one block per stage; params: nanotron's split by parameter cost"),
    "selective_reruns": (("attention", "policy"),
                         "attention: the attention core's forward again; policy: what the selective policy does not "
                         "keep"),
}
# [framework] numbers beyond the sign rule (every number is finite and >= 0: bytes, µs, counts, shares), in the
# hardware fields' shape (`hardware._SHARES`)
_AT_LEAST_ZERO = Range(0.0, True, None, True, ">= 0")
_FRAMEWORK_RANGES = {
    "tp_overlap": Range(0.0, True, 1.0, True, "a share of tensor-parallel communication, in [0, 1]"),
    "usable_memory_fraction": Range(0.0, False, 1.0, True, "a share of the device's memory, in (0, 1]"),
    "activation_scale": Range(0.0, False, None, True, "> 0 (it multiplies the counted activations)"),
    "param_bytes": Range(1.0, True, None, True, ">= 1 (bytes per stored parameter)"),
}


def all_frameworks() -> dict[str, Framework]:
    """Every framework the planner knows: the ones in code (`layout.FRAMEWORKS`) and the data files of
    `planner/frameworks/` (each a profile with only a [framework] table)."""
    known = dict(FRAMEWORKS)
    for path in sorted(FRAMEWORK_DIR.glob("*.toml")):
        fw = _framework_table(_read(path).get("framework"), str(path), known)
        if fw is not None:
            known[fw.name] = fw
    return known


def framework_of(path: str | Path, default: str | None = None) -> Framework | None:
    """The profile's [framework] table as a `Framework` (its `name`, else `default`, with the table's fields),
    or None when the profile has no such table."""
    return _framework_table(_read(path).get("framework"), str(path), all_frameworks(), default)


def _framework_table(table, where: str, known: dict[str, Framework], default: str | None = None
                     ) -> Framework | None:
    """`name` (a known framework, or a new one with `base` = the known framework it starts from) plus
    fields of `Framework` to override, each checked."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"--hardware {shown(where)}: [framework] must be a table")
    table = dict(table)
    for key in ("name", "base"):
        if key in table and (not isinstance(table[key], str) or not table[key].strip()):
            raise ConfigError(f"--hardware {shown(where)}: [framework] {key} = {shown(table[key])} must be a non-empty "
                              "string (a framework's name)")
    name = str(table.pop("name", default or "fivefold"))
    base_name = str(table.pop("base", name))
    if base_name not in known:
        raise ConfigError(f"--hardware {shown(where)}: [framework] {'base' if base_name != name else 'name'} = "
                          f"{shown(base_name)} is not known{did_you_mean(base_name, known)}; choose one of: "
                          f"{', '.join(sorted(known))}")
    base = known[base_name]
    fields = {f.name for f in dataclasses.fields(Framework)} - {"name"}
    for key, value in table.items():
        if key not in fields:
            raise ConfigError(f"--hardware {shown(where)}: [framework] field {shown(key)} is not known"
                              f"{did_you_mean(key, fields)}; known fields: "
                              f"{', '.join(sorted(fields))}")
        current = getattr(base, key)
        kind = bool if isinstance(current, bool) else (int, float) if isinstance(current, int | float) else str
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ConfigError(f"--hardware {shown(where)}: [framework] {key} = {shown(value)} must be of the type of "
                              f"its default, {shown(current)}")
        if kind is not bool and kind is not str:  # finite, whole where the default is, >= 0, within its range
            here = f"--hardware {shown(where)}: [framework]"
            value = checked_number(value, here, key, integer=isinstance(current, int),
                                   within=_FRAMEWORK_RANGES.get(key, _AT_LEAST_ZERO))
        choices, meaning = _FRAMEWORK_CHOICES.get(key, (None, ""))
        if choices is not None and value not in choices:
            raise ConfigError(f"--hardware {shown(where)}: [framework] {key} = {shown(value)} is not one of "
                              f"{', '.join(choices)}{f' ({meaning})' if meaning else ''}")
        if key == "fused_elementwise":
            names = [c.strip() for c in str(value).split(",") if c.strip()]
            bad = [c for c in names if c not in (*ELEMENTWISE_CLASSES, "all")]
            if bad:
                raise ConfigError(f"--hardware {shown(where)}: [framework] fused_elementwise = {shown(value)}: "
                                  f"{shown(bad[0])} is not "
                                  f"a kernel class; use a comma-separated list of {', '.join(ELEMENTWISE_CLASSES)} "
                                  "or all")
        if key == "features":
            from fivefold.planner.features import FEATURES

            bad = [f.strip() for f in str(value).split(",") if f.strip() and f.strip() not in FEATURES]
            if bad:
                raise ConfigError(f"--hardware {shown(where)}: [framework] features = {shown(value)}: "
                                  f"{shown(bad[0])} is not a "
                                  f"feature; use a comma-separated list of {', '.join(FEATURES)} (or \"\": none)")
        if key == "attention_kernel":
            kernels = sorted({row[0] for dk in all_devices().values() for row in dk.attention})
            if value not in kernels:
                raise ConfigError(f"--hardware {shown(where)}: [framework] attention_kernel = {shown(value)} "
                                  f"has no rows in "
                                  f"planner/devices/kernels.toml; choose one of: {', '.join(kernels)}")
        table[key] = type(current)(value)
    return dataclasses.replace(base, name=name, **table)


def load(path: str | Path | None, framework: str | None = None, default_hardware: str = "h100"
         ) -> tuple[Framework | None, Cluster]:
    """The framework (None when the profile names none and `framework` is None) and the cluster of a
    profile; `framework` given on the command line chooses the framework, the profile's table then overrides
    its fields only when it names the same framework."""
    known = all_frameworks()
    if framework is not None and framework not in known:
        raise ConfigError(f"--framework {shown(framework)} is not known; choose one of: {', '.join(sorted(known))}")
    if path is None:
        return (known[framework] if framework else None), get_cluster(default_hardware)
    fw = framework_of(path, framework)
    if framework and (fw is None or fw.name != framework):
        fw = known[framework]
    return fw, get_cluster(default_hardware, path)


def write(path: str | Path, fw: Framework, hw: Cluster, base_hw: str, header: str = "") -> None:
    """A profile of `fw` and `hw`: the fields that differ from the framework's defaults and from the preset
    `base_hw` (only scalar fields; the measured tables are `calibrate`'s)."""
    base_fw = all_frameworks().get(fw.name, Framework())
    lines = [f"# {line}" for line in header.splitlines()] + ["[framework]", f'name = "{fw.name}"']
    for f in dataclasses.fields(Framework):
        value = getattr(fw, f.name)
        if f.name != "name" and value != getattr(base_fw, f.name):
            lines.append(f"{f.name} = {_toml(value)}")
    lines += ["", "[hardware]", f'base = "{base_hw}"']
    preset = get_cluster(base_hw)
    for f in dataclasses.fields(Cluster):
        value = getattr(hw, f.name)
        if f.name != "name" and isinstance(value, int | float) and value != getattr(preset, f.name):
            lines.append(f"{f.name} = {_toml(value)}")
    write_text_atomic(path, "\n".join(lines) + "\n")


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
