"""Checks before a run starts: everything that would otherwise fail after files are written or memory is taken.

Each check raises `ConfigError` (printed without a traceback, exit status 2) naming the field or option, the
value, the rule and what would work; `warnings` returns lines for settings that work but probably were not
meant (a step, a run or an evaluation that takes hours). Whether the run fits in memory, and how long its step
takes, is the planner's prediction (`fivefold.planner.predict.check_fits`), which the command line runs beside
`check_start`: this layer sits below the planner and does not model memory or time itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fivefold.config import Config, ConfigError, check_writable_dir, shown
from fivefold.device import present_device
from fivefold.parallel.float8 import check_float8
from fivefold.train.metrics import check_logging_backends


def check_nproc(nproc: int, nodes: int = 1) -> None:
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be >= 1 (the processes to start on this node, one per device)")
    if nodes < 1:
        raise ConfigError(f"--nodes = {nodes} must be >= 1")


def check_run_dir_writable(run_dir: Path, resume: bool) -> None:
    """The run directory, and its `checkpoints/` when it has one, can be created and written, checked without
    leaving anything behind."""
    if resume and not run_dir.is_dir():
        raise ConfigError(f"--resume: run directory {shown(str(run_dir))} does not exist; give the --run-dir of the "
                          "run to continue, or drop --resume to start a new one")
    check_writable_dir(run_dir, "--run-dir")
    if (run_dir / "checkpoints").is_dir():
        probe_write(run_dir / "checkpoints", "--run-dir")


def probe_write(folder: Path, flag: str) -> None:
    """A file can be created in `folder` (created and removed at once); a ConfigError naming `flag` if not."""
    probe = folder / ".fivefold-write-test"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag} {shown(str(folder))} cannot be written ({e.strerror or e}); make it writable "
                          "(chmod u+w) or choose a run directory under a writable directory") from None


def check_hf_dir(path: str) -> None:
    """`--hf DIR` holds a config.json and safetensors weights."""
    hf = Path(path)
    if not hf.is_dir():
        raise ConfigError(f"--hf {shown(path)} is not a directory; give a Hugging Face Llama directory "
                          f"(config.json and "
                          "model.safetensors)")
    if not (hf / "config.json").is_file():
        raise ConfigError(f"--hf {shown(path)} has no config.json; a Hugging Face Llama directory holds "
                          f"config.json and "
                          "model.safetensors")
    if not (hf / "model.safetensors").is_file() and not (hf / "model.safetensors.index.json").is_file():
        pickles = sorted(p.name for p in hf.glob("*.bin"))
        hint = f" (found {', '.join(pickles)}: pickled weights are not read; re-save them as safetensors)" \
            if pickles else ""
        raise ConfigError(f"--hf {shown(path)} has no model.safetensors or model.safetensors.index.json{hint}")


def check_extras(cfg: Config) -> None:
    """The optional packages that the config asks for, before anything is written."""
    check_logging_backends(cfg.log)


LONG_RUN_S = 3600  # a run predicted to take longer than this says so before it starts


def warnings(cfg: Config, device: torch.device, step_s: float) -> list[str]:
    """Settings that work but probably were not meant, given the predicted seconds of one optimizer step."""
    t = cfg.train
    out = []
    # a warm-up longer than the run is said once, by the loop (train.loop), on every path into training
    tokens = t.global_batch_size * t.seq_len
    run_s = step_s * t.max_steps
    # an evaluation is a forward (a third of a step's work per token) of eval_batches x <= 16 rows
    eval_s = step_s / 3 / t.global_batch_size * 16 * t.eval_batches
    ranks = f"on {max(cfg.layout.world_size, 1)} {device.type} rank(s), as the planner predicts"
    if run_s > LONG_RUN_S or step_s > 600:
        out.append(f"this run is predicted to take ~{rough_duration(run_s)}: train.max_steps = {t.max_steps} steps of "
                   f"train.global_batch_size = {t.global_batch_size} x train.seq_len = {t.seq_len} = {tokens:,} "
                   f"tokens, ~{rough_duration(step_s)} per step {ranks}; stop it with Ctrl-C (it saves a checkpoint) "
                   "if that is not what you meant")
    if t.float8 != "off" and device.type == "cpu":
        out.append(f"train.float8 = {t.float8!r} on the CPU runs PyTorch's reference float8 kernels: correct, and 2 "
                   "to 4 times slower than fp32 (for tests; float8 speeds up GPUs of compute capability 8.9 or newer)")
    if eval_s > 600:
        out.append(f"train.eval_batches = {t.eval_batches}: each evaluation takes ~{rough_duration(eval_s)} ({ranks}); "
                   f"evaluations run at step 0, every train.eval_every = {t.eval_every} steps and at the end")
    return out


def rough_duration(s: float) -> str:
    """A predicted duration in the unit that reads best: seconds, minutes, hours or days."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:,.0f} days"


def check_start(cfg: Config, resume: bool = False, run_dir: bool = True) -> torch.device | None:
    """What this machine must offer the run (the device, the optional packages, a writable run directory),
    checked once by the process the user started, before anything is written: the device the run uses, or None
    in a started worker (its launcher checked). The command line then checks the memory with the planner's
    prediction on that device and prints `warnings`."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    device = present_device(cfg.train.device, "train.device")
    cores = os.cpu_count() or 1
    if cfg.train.threads > cores:
        raise ConfigError(f"train.threads = {cfg.train.threads} exceeds this machine's {cores} CPU cores: more "
                          f"threads than cores only wait for each other; use at most {cores} (0: the default share)")
    check_extras(cfg)
    check_float8(cfg.train.float8, device)
    if run_dir:
        check_run_dir_writable(Path(cfg.run_dir), resume)
    return device
