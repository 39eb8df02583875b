"""The planner's prediction for one run of fivefold: the layout of a `Config` on a described cluster.

`predict_run` is what `fivefold sweep` records beside each measurement; it turns the config into the planner's
`Layout` (the gradient accumulation follows from the global batch) and calls `estimate` with fivefold's own
implementation settings (`FIVEFOLD` under bf16 on accelerators, `FIVEFOLD_CPU` for fp32 compute; with the
`compile` feature when `train.compile` is on). The time
model underneath may improve (a calibrated hardware profile); this function's inputs and keys stay.

`check_fits` is the start-up check of `fivefold train` and `fivefold bench`: the same prediction, on the
device the run will use (`device_cluster`), refusing only a run that it says cannot fit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fivefold.accelerators import device_hardware
from fivefold.config import Config, ConfigError
from fivefold.device import device_memory_bytes, resolve_device, use_bf16
from fivefold.flops import count_params
from fivefold.planner.features import with_features
from fivefold.planner.hardware import Cluster, get_cluster
from fivefold.planner.layout import FIVEFOLD, FIVEFOLD_CPU, Framework, Layout
from fivefold.planner.search import Estimate, estimate, gib


def layout_of(cfg: Config) -> Layout:
    """The planner's layout for a config: every layout field (a `Layout` is a `LayoutConfig`), with the micro-batch
    and gradient accumulation resolved and sequence parallel only where tp > 1 (as the engine applies it)."""
    la = cfg.layout
    fields = {f.name: getattr(la, f.name) for f in dataclasses.fields(la)}
    return Layout(**{**fields, "sp": la.sp and la.tp > 1, "micro_batch_size": cfg.micro_batch_size,
                     "grad_accum_steps": cfg.grad_accum_steps})


def compute_dtype(cfg: Config, device_type: str) -> str:
    """bf16 or fp32, as the engine resolves `train.dtype` on this kind of device (`use_bf16`)."""
    return "bf16" if use_bf16(cfg, device_type) else "fp32"


def engine_framework(fp32: bool, compiled: bool, float8: bool = False) -> Framework:
    """fivefold's own engine as the planner models it: `FIVEFOLD_CPU` computing in fp32, `FIVEFOLD` (lean bf16)
    otherwise; with the `compile` feature (fused element-wise kernels) when its blocks run compiled, and the `float8`
    feature when its linears run in float8 (`train.float8`)."""
    framework = FIVEFOLD_CPU if fp32 else FIVEFOLD
    return with_features(framework, ("compile",) * compiled + ("float8",) * float8)


def default_hardware(device_type: str) -> Cluster:
    """The built-in profile for the kind of device that runs: the preset whose name matches this machine's
    accelerator, `h100` for an accelerator not in the table, `cpu` on CPU."""
    if device_type == "cpu":
        return get_cluster("cpu")
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    hw = device_hardware(acc) if acc is not None else None
    return get_cluster(hw.name if hw is not None else "h100")


def load_hardware(file: str | Path | None, device_type: str) -> Cluster:
    """`--hardware FILE` as `fivefold plan` reads it, else the built-in profile for the device kind."""
    if file:
        return get_cluster(None, file)
    return default_hardware(device_type)


def on_one_node(hardware: Cluster, n_devices: int) -> Cluster:
    """`hardware` with room for `n_devices` on its node: a local run puts every process on this one."""
    return dataclasses.replace(hardware, gpus_per_node=max(hardware.gpus_per_node, n_devices))


def run_framework(cfg: Config, device_type: str) -> Framework:
    """fivefold's engine as it runs `cfg` on this kind of device (`train.dtype` resolved there, compiled when
    `train.compile`, float8 under `train.float8`); `device_type` is a torch device type, or any name but "cpu" for
    an accelerator."""
    return engine_framework(compute_dtype(cfg, device_type) == "fp32", cfg.train.compile, cfg.train.float8 != "off")


def estimate_run(cfg: Config, hardware: Cluster, device_type: str | None = None) -> Estimate:
    """The planner's `Estimate` of `cfg` with fivefold's settings for the precision it computes in."""
    if device_type is None:  # the config's device kind, as a name (a run that failed may name a device not here)
        device_type = cfg.train.device.split(":")[0]
        if device_type == "auto":
            device_type = resolve_device("auto").type
    return estimate(cfg.model, cfg.train.seq_len, layout_of(cfg), run_framework(cfg, device_type), hardware, True)


def predict_run(cfg: Config, hardware: Cluster, device_type: str | None = None) -> dict:
    """Predicted step time, tokens/s per device, MFU and peak memory per device of `cfg` on `hardware`.

    `device_type` (cpu, cuda, ...) picks the compute precision when `train.dtype` is auto; default: the
    config's `train.device`, or this machine's accelerator for `auto`. Keys: `step_time_s`,
    `tokens_per_s_per_device`, `mfu`, `peak_memory_bytes`, `fits`, `time_s` (step time by cause),
    `memory_bytes` (peak by part of the most loaded pipeline rank), `hardware`, `layout`."""
    e = estimate_run(cfg, hardware, device_type)
    _, parts = e.peak_rank
    return {
        "step_time_s": e.step_time_s, "tokens_per_s_per_device": e.tokens_per_s_per_device, "mfu": e.mfu,
        "peak_memory_bytes": e.peak_bytes, "fits": e.fits, "time_s": dict(e.time_parts),
        "memory_bytes": dict(parts), "hardware": hardware.name,
        "layout": dataclasses.asdict(e.layout),
    }


# the parts of the planner's memory that hold the model's state rather than a micro-batch's activations
STATE_PARTS = ("parameters", "gradients", "optimizer", "grad_accum_buffer", "bf16_weight_copies")


def engine_parts(parts: dict[str, float]) -> dict[str, float]:
    """One rank's planner memory `parts` grouped as a run measures them: the model states as the engine counts
    them (`Engine.state_bytes`: parameters, gradients, and optimizer with any separate fp32 accumulation buffer),
    activations (with the autocast weight copies and the transient of the loss or a recomputed block) and buffers
    (communication buffers and the fixed overhead); and the C allocator's cache where a profile's `heap_retention`
    adds one (`allocator_cache`, only then)."""
    rest = dict(parts)
    states = {"parameters": rest.pop("parameters"), "gradients": rest.pop("gradients"),
              "optimizer": rest.pop("optimizer") + rest.pop("grad_accum_buffer", 0.0)}
    activations = rest.pop("activations") + rest.pop("bf16_weight_copies", 0.0) + rest.pop("transient", 0.0)
    cache = rest.pop("allocator_cache", 0.0)
    return {**states, "activations": activations, "buffers": sum(rest.values()),
            **({"allocator_cache": cache} if cache else {})}


def device_cluster(device: torch.device, local_ranks: int, hardware_file: str | Path | None = None) -> Cluster:
    """The planner's profile of the device a run uses (`hardware_file`'s, e.g. one `fivefold calibrate` wrote, else
    `default_hardware` of its kind) with that device's memory: the accelerator's total, or on CPU the machine's RAM
    shared by the `local_ranks` processes of this node (the profile's own figure when neither can be read); room
    for the local ranks on one node."""
    return with_device_memory(on_one_node(load_hardware(hardware_file, device.type), local_ranks), device,
                              local_ranks)


def with_device_memory(hardware: Cluster, device: torch.device, local_ranks: int) -> Cluster:
    """`hardware` with the memory one of `local_ranks` ranks on `device` can use (`device_memory_bytes`: the
    accelerator's total, or on CPU this machine's RAM shared by the ranks), the profile's own figure when it cannot
    be read: what the start-up check (`check_fits`) and `fivefold train --dry-run` compare the prediction with."""
    have = device_memory_bytes(device, local_ranks)
    return dataclasses.replace(hardware, memory_gib=have / 2**30) if have else hardware


def check_fits(cfg: Config, hardware: Cluster, device_type: str) -> Estimate:
    """The start-up check of a run's memory: the planner's prediction of the engine running `cfg` on `hardware`
    (`device_type`: the torch device type the run uses, which resolves `train.dtype`), as `fivefold plan --layout`
    and `fivefold train --dry-run` make it. Raises `ConfigError` when that prediction does not fit, with the
    predicted GiB by part against the device's; returns the estimate otherwise (its step time feeds the warnings)."""
    e = estimate_run(cfg, hardware, device_type)
    if e.fits:
        return e
    if e.notes:
        raise ConfigError(f"layout: {'; '.join(e.notes)}; `fivefold plan` finds a layout that works")
    rank, parts = e.peak_rank
    usable = hardware.memory_gib * run_framework(cfg, device_type).usable_memory_fraction
    shown = ", ".join(f"{name} {gib(v):,.1f}" for name, v in parts.items() if gib(v) >= 0.05)
    figure = (f"the planner predicts a peak of {gib(e.peak_bytes):,.1f} GiB per device"
              + (f" on the {rank} pipeline rank" if len(e.memory) > 1 else "")
              + f" ({shown} GiB), but a {hardware.name} device has {hardware.memory_gib:,.1f} GiB, of which the engine "
              f"may use {usable:,.1f} GiB")
    la, m, t = cfg.layout, cfg.model, cfg.train
    more = "or more ranks (`fivefold plan` finds a layout that fits)"
    states = sum(parts.get(k, 0.0) for k in STATE_PARTS)
    if states >= e.peak_bytes - states:
        raise ConfigError(
            f"model.hidden = {m.hidden}, model.n_layers = {m.n_layers}, model.ffn = {m.ffn}, model.vocab_size = "
            f"{m.vocab_size} ({count_params(m):,} parameters) on {la.world_size} rank(s) with layout.zero = "
            f"{la.zero}: {figure}, {gib(states):,.1f} GiB of it weights, gradients and optimizer state; use a smaller "
            f"model (see `fivefold models`), {'a higher --layout.zero, ' if la.zero < 3 else ''}{more}")
    raise ConfigError(
        f"layout.micro_batch_size = {cfg.micro_batch_size} sequences (train.global_batch_size = "
        f"{t.global_batch_size} / layout.dp = {la.dp}, when micro_batch_size is 0) x train.seq_len = {t.seq_len} "
        f"with layout.recompute = {la.recompute}: {figure}; set a smaller --layout.micro_batch_size (gradient "
        f"accumulation keeps the global batch), {'--layout.recompute full, ' if la.recompute != 'full' else ''}"
        f"{more}")
