"""Checks before a run starts: everything that would otherwise fail after files are written or memory is taken.

Each check raises `ConfigError` (printed without a traceback, exit status 2) naming the field or option, the
value, the rule and what would work; `warnings` returns lines for settings that work but probably were not
meant (a warm-up longer than the run, a step that reads the dataset many times over).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fivefold.config import Config, ConfigError

BYTES_PER_PARAM = 16  # fp32 weights, gradients and Adam's two moments: the least a trained parameter takes


def check_nproc(nproc: int, nodes: int = 1) -> None:
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be >= 1 (the processes to start on this node, one per device)")
    if nodes < 1:
        raise ConfigError(f"--nodes = {nodes} must be >= 1")


def check_device(name: str) -> torch.device:
    """The device `train.device` names, present on this machine."""
    from fivefold.config import check_device_name
    from fivefold.device import resolve_device

    check_device_name(name)
    device = resolve_device(name)
    if device.type == "cpu":
        return device
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != device.type:
        have = f"this machine's accelerator is {acc.type}" if acc is not None else "this machine has no accelerator"
        raise ConfigError(f"train.device = {name!r}: {have}; use train.device = auto or cpu"
                          + (f" or {acc.type}" if acc is not None else ""))
    count = torch.accelerator.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"train.device = {name!r}: this machine has {count} {device.type} device(s), numbered "
                          f"0 to {count - 1}")
    return device


def device_memory_bytes(device: torch.device, local_ranks: int) -> int:
    """Memory one rank can use at most: the accelerator's total, or the machine's RAM shared by its ranks."""
    if device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0
        return total // max(local_ranks, 1)
    module = getattr(torch, device.type, None)
    try:
        return int(module.get_device_properties(device.index or 0).total_memory)
    except (AttributeError, RuntimeError, AssertionError):
        return 0


def check_memory(cfg: Config, device: torch.device, local_ranks: int) -> None:
    """Refuse a run whose weights, gradients and optimizer state (spread over every rank) plus one micro-batch's
    fp32 logits cannot fit in a rank's memory: a lower bound, so it never refuses a run that would fit."""
    from fivefold.flops import count_params

    params = count_params(cfg.model)
    la, t = cfg.layout, cfg.train
    world = max(la.world_size, 1)
    states = BYTES_PER_PARAM * params / world
    logits = 4 * cfg.micro_batch_size * (t.seq_len // la.cp) * cfg.model.vocab_size / la.tp
    have = device_memory_bytes(device, local_ranks)
    if not have or states + logits <= have:
        return
    gib = 2**30
    if states >= logits:
        raise ConfigError(
            f"model.hidden = {cfg.model.hidden}, model.n_layers = {cfg.model.n_layers}, model.ffn = {cfg.model.ffn}, "
            f"model.vocab_size = {cfg.model.vocab_size}: {params:,} parameters need at least {states / gib:,.1f} GiB "
            f"per rank for weights, gradients and Adam state ({BYTES_PER_PARAM} bytes each over {world} rank(s)), "
            f"but a rank has {have / gib:,.1f} GiB of {device.type} memory; use a smaller model (see `fivefold "
            "models`) or more ranks (`fivefold plan` finds a layout that fits)")
    raise ConfigError(
        f"layout.micro_batch_size = {cfg.micro_batch_size} sequences (train.global_batch_size = "
        f"{t.global_batch_size} / layout.dp = {la.dp}, when micro_batch_size is 0) x train.seq_len = {t.seq_len}: "
        f"the logits alone take {logits / gib:,.1f} GiB per rank, but a rank has {have / gib:,.1f} GiB of "
        f"{device.type} memory; set a smaller --layout.micro_batch_size (gradient accumulation keeps the global "
        "batch) or a smaller train.global_batch_size")


def check_run_dir_writable(run_dir: Path, resume: bool) -> None:
    """The run directory can be created and written, checked without leaving anything behind."""
    if resume:
        if not run_dir.is_dir():
            raise ConfigError(f"--resume: run directory {str(run_dir)!r} does not exist; give the --run-dir of the "
                              "run to continue, or drop --resume to start a new one")
        return
    missing: list[Path] = []
    path = run_dir.absolute()
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--run-dir {str(run_dir)!r}: {str(path)!r} is a file, not a directory; choose a "
                          "run directory under a writable directory (default: runs/NAME-TIME)")
    try:
        for p in reversed(missing):
            p.mkdir()
        probe = run_dir / ".fivefold-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--run-dir {str(run_dir)!r} cannot be written ({e.strerror or e}); choose a run "
                          "directory under a writable directory (default: runs/NAME-TIME)") from None
    finally:
        for p in missing:  # as we found it
            try:
                p.rmdir()
            except OSError:
                pass


def check_hf_dir(path: str) -> None:
    """`--hf DIR` holds a config.json and safetensors weights."""
    hf = Path(path)
    if not hf.is_dir():
        raise ConfigError(f"--hf {path!r} is not a directory; give a Hugging Face Llama directory (config.json and "
                          "model.safetensors)")
    if not (hf / "config.json").is_file():
        raise ConfigError(f"--hf {path!r} has no config.json; a Hugging Face Llama directory holds config.json and "
                          "model.safetensors")
    if not (hf / "model.safetensors").is_file() and not (hf / "model.safetensors.index.json").is_file():
        pickles = sorted(p.name for p in hf.glob("*.bin"))
        hint = f" (found {', '.join(pickles)}: pickled weights are not read; re-save them as safetensors)" \
            if pickles else ""
        raise ConfigError(f"--hf {path!r} has no model.safetensors or model.safetensors.index.json{hint}")


def check_extras(cfg: Config) -> None:
    """The optional packages that the config asks for, before anything is written."""
    from fivefold.train.metrics import check_logging_backends

    check_logging_backends(cfg.log)


def warnings(cfg: Config, device: torch.device) -> list[str]:
    """Settings that work but probably were not meant."""
    from fivefold.flops import training_flops_per_token

    t = cfg.train
    out = []
    # a warm-up longer than the run is said once, by the loop (train.loop), on every path into training
    tokens = t.global_batch_size * t.seq_len
    flops = training_flops_per_token(cfg.model, t.seq_len) * tokens
    # rough rates: 100 TFLOP/s per accelerator, 0.2 TFLOP/s per CPU process
    rate = (100e12 if device.type != "cpu" else 0.2e12) * max(cfg.layout.world_size, 1)
    step_s = flops / rate
    run_s = step_s * t.max_steps
    eval_s = flops / 3 / t.global_batch_size * 16 * t.eval_batches / rate  # forward of eval_batches x <= 16 rows
    if run_s > 24 * 3600 or step_s > 600:
        out.append(f"train.global_batch_size = {t.global_batch_size} x train.seq_len = {t.seq_len} = {tokens:,} "
                   f"tokens per step: ~{_duration(step_s)} per step and ~{_duration(run_s)} for {t.max_steps} steps on "
                   f"{max(cfg.layout.world_size, 1)} {device.type} rank(s) (at {rate / 1e12:g} TFLOP/s)")
    if eval_s > 600:
        out.append(f"train.eval_batches = {t.eval_batches}: each evaluation takes ~{_duration(eval_s)} (at "
                   f"{rate / 1e12:g} TFLOP/s); evaluations run at step 0, every train.eval_every = {t.eval_every} "
                   "steps and at the end")
    return out


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:,.0f} days"


def check_start(cfg: Config, nproc: int, resume: bool = False, run_dir: bool = True, warn: bool = True) -> None:
    """What this machine must offer the run (the device, its memory, the optional packages, a writable run
    directory), checked once by the process the user started, before anything is written; then warnings for
    settings that work but were probably not meant."""
    import sys

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a started worker: its launcher checked
        return
    device = check_device(cfg.train.device)
    check_extras(cfg)
    check_memory(cfg, device, nproc)
    if run_dir:
        check_run_dir_writable(Path(cfg.run_dir), resume)
    for line in warnings(cfg, device) if warn else []:
        print(f"fivefold: warning: {line}", file=sys.stderr)
