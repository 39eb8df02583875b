"""Device helpers shared by every layer: which device a run uses, which accelerator a launched process owns,
and whether it computes in bf16 (lean mixed precision: bf16 working weights and gradients under autocast, fp32
master weights beside them)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping

import torch

from fivefold.config import Config, ConfigError, check_device_name, shown


def resolve_device(name: str) -> torch.device:
    """`auto` picks the current accelerator (CUDA, XPU, ROCm, ...) if there is one, else the CPU."""
    if name == "auto":
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return acc if acc is not None else torch.device("cpu")
    return torch.device(name)


def present_device(name: str, field: str) -> torch.device:
    """The device `name` (the value of `field`, named in errors) names, known to PyTorch and present here."""
    check_device_name(name, field)
    device = resolve_device(name)
    if device.type == "cpu":
        return device
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != device.type:
        have = f"this machine's accelerator is {acc.type}" if acc is not None else "this machine has no accelerator"
        raise ConfigError(f"{field} = {shown(name)}: {have}; use {field} = auto or cpu"
                          + (f" or {acc.type}" if acc is not None else ""))
    count = torch.accelerator.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"{field} = {shown(name)}: this machine has {count} {device.type} device(s), numbered "
                          f"0 to {count - 1}")
    return device


def local_device(device_type: str) -> torch.device:
    """This process's device: the accelerator numbered LOCAL_RANK on its node, or the CPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))


def device_memory_bytes(device: torch.device, local_ranks: int) -> int:
    """Memory one rank can use at most: the accelerator's total, or the machine's RAM shared by its `local_ranks`
    ranks; 0 when it cannot be read."""
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


def use_bf16(cfg: Config, device: torch.device | str) -> bool:
    """bf16 compute (lean mixed precision: bf16 working weights, fp32 master weights) on accelerators by default,
    fp32 on CPU (`device`: a device or its type)."""
    kind = device if isinstance(device, str) else device.type
    return cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and kind != "cpu")


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` when `bf16`, else a context that changes nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads(local_processes: int) -> int:
    """CPU intra-op threads per process when train.threads = 0: this process's cores divided by the processes on
    this machine (PyTorch's default of every core per process oversubscribes them; the launcher gives the workers
    as many OpenMP threads)."""
    return max(1, available_cores() // max(1, local_processes))


CPU_PROCESSES_PER_CORE = 2  # local CPU processes of one run past which they mostly wait for each other
CPU_PROCESSES_MIN = 4  # always allowed: `fivefold calibrate`'s ranks on a CPU, a sweep's dp4 on a 2-core laptop


def max_cpu_processes() -> int:
    """The most local CPU processes one run sensibly starts here: CPU_PROCESSES_PER_CORE per core (each has one
    intra-op thread from `default_threads` once they outnumber the cores), at least CPU_PROCESSES_MIN."""
    return max(CPU_PROCESSES_MIN, CPU_PROCESSES_PER_CORE * available_cores())


# glibc's per-thread cache of freed small chunks (tcache), off for the CPU processes fivefold starts: with it, a
# tensor-parallel CPU run's heap grew at every step while its live bytes did not (tp2 + sp on the tiny model: 282-306
# MiB resident above the baseline after 25 steps, 74-75 MiB with the cache off and no slower; tp2 202 -> 71-76; dp2
# 114-117 -> 100-101; one process about 10 % less; docs/sweeps.md): the chunks it holds keep the larger free chunks
# around them from coalescing. A process reads GLIBC_TUNABLES when it starts, so this is set in the environment of
# the processes fivefold starts (the local ranks of `--nproc`, a sweep's runs, calibrate's), not of one started
# by hand; a GLIBC_TUNABLES that already sets the cache's count is kept.
TCACHE_TUNABLE = "glibc.malloc.tcache_count"


def cpu_allocator_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with glibc's tcache off (`TCACHE_TUNABLE` = 0, appended to any other GLIBC_TUNABLES), for a CPU process
    to start on Linux; unchanged elsewhere or where GLIBC_TUNABLES already sets the count."""
    out = dict(env)
    tunables = out.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or TCACHE_TUNABLE in tunables:
        return out
    out["GLIBC_TUNABLES"] = f"{tunables}:{TCACHE_TUNABLE}=0" if tunables else f"{TCACHE_TUNABLE}=0"
    return out
