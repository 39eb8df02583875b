"""The hardware profile `fivefold calibrate` writes: the TOML tables of the groups' figures (top level from one
rank, `[ranks.N]` from N ranks) and their text."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.planner.hardware import PRESETS, get_cluster
from fivefold.planner.predict import default_hardware
from fivefold.tools.calibrate.fit import fit_link
from fivefold.tools.calibrate.targets import Result


def profile_tables(results: dict[int, Result], device_type: str, threads: dict[int, int], nproc: int,
                   name: str) -> dict:
    """The TOML tables of a profile: top level from one rank, [ranks.N] from N ranks (on a CPU, `threads[N]`
    intra-op threads each)."""
    one = results[1]
    cpu = device_type == "cpu"
    best = max(r[3] for r in one.linear)
    top: dict = {"name": name, "base": default_hardware(device_type).name}
    if cpu:
        top["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        top["threads_per_rank"] = threads[1]
        top["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        top["fp32_tflops"] = top["bf16_tflops"] = best
        top["hbm_gbps"] = max(r[1] for r in one.elementwise)
    else:
        top["matmul_efficiency"] = 1.0  # the tables hold what is achieved
    top["gpus_per_node"] = nproc
    top.update(compute_fields(one))
    if 2 in results and results[2].collectives.get("all_reduce", {}).get(2):
        latency, bandwidth = fit_link(results[2].collectives["all_reduce"][2], 2)
        top["intra_latency_us"], top["intra_node_gbps"] = 1e6 * latency, bandwidth / 1e9
    ranks = {}
    for n, r in sorted(results.items()):
        if n == 1:
            continue
        section = {"threads_per_rank": threads[n], **compute_fields(r)} if cpu else {}
        section["comm_overlap"] = r.comm_overlap
        section["zero3_unit_us"] = r.zero3_unit_us
        section["posted_p2p_wait_us"] = r.posted_p2p_wait_us
        if r.collective_wait:
            section["collective_wait"] = r.collective_wait
        section["collectives"] = {k: {str(s): rows for s, rows in v.items()} for k, v in r.collectives.items()}
        ranks[str(n)] = section
    if ranks:
        top["ranks"] = ranks
    return top


def compute_fields(r: Result) -> dict:
    fields = {"kernel_overhead_us": r.kernel_overhead_us, "backward_overhead_us": r.backward_overhead_us,
              "optimizer_gbps": r.optimizer_gbps, "optimizer_tensor_us": r.optimizer_tensor_us,
              "linear": r.linear, "attention": r.attention, "loss": r.loss, "elementwise": r.elementwise}
    return {k: v for k, v in fields.items() if v != []}


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def _value(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        if v and isinstance(v[0], list):
            return "[\n" + "".join(f"  {_value(row)},\n" for row in v) + "]"
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return _number(v)


def to_toml(tables: dict, header: str = "") -> str:
    """TOML text of nested dicts of numbers, strings and lists (the profile's shape)."""
    lines = [f"# {line}" for line in header.splitlines()]

    def emit(d: dict, path: list[str]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        subs = {k: v for k, v in d.items() if isinstance(v, dict)}
        if path and scalars:
            lines.append(f"\n[{'.'.join(path)}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_value(v)}")
        for k, v in subs.items():
            emit(v, [*path, k])

    emit(tables, [])
    return "\n".join(lines) + "\n"


def profile_header(quick: bool, host: str, device_type: str, seconds: float, when: str, load: str) -> str:
    """The comment at the top of a profile: how it was made and how to read its tables."""
    import torch

    return (f"written by `fivefold calibrate{' --quick' if quick else ''}` on {host} "
            f"({device_type}, torch {torch.__version__}) in {seconds:.0f} s, {when}\n"
            "top level: measured with 1 rank; [ranks.N]: with N ranks running at once on this machine.\n"
            "linear rows: m, n, k, forward TFLOP/s, backward TFLOP/s; attention rows: batch x heads, seq, "
            "head dim, forward, backward TFLOP/s;\nloss rows: tokens, vocabulary, hidden, forward, backward "
            "TFLOP/s (of the output layer's matmul);\nelement-wise rows: operand bytes, GB/s; collectives: "
            f"[ranks.N.collectives.KIND] group size = [[bytes, seconds], ...]\n{load}")


def profile_name(path: Path) -> str:
    """The profile's name: its file's, never a built-in profile's (a store's predictions name the profile they
    used)."""
    return path.stem if path.stem.lower() not in PRESETS else f"{path.stem}-calibrated"


def write_profile(path: Path, tables: dict, text_header: str) -> None:
    """Write the profile's TOML atomically (never a half-written file in its place), once the planner's own reader
    (`get_cluster`) has read it back: a measured value that the reader would refuse (a `selective_dispatch_us` of 0 on
    a loaded machine was one) is a ConfigError here, naming the field, and nothing is written."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.writing.toml")
    tmp.write_text(to_toml(tables, text_header))
    try:
        get_cluster(None, tmp)
    except ConfigError as e:
        tmp.unlink()
        raise ConfigError(f"the measured profile would be refused by the planner's reader: "
                          f"{str(e).replace(str(tmp), str(path))}; {path} was not written") from None
    tmp.replace(path)
