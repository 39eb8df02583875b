"""Parallel training: the process grid (`mesh`), data parallel and ZeRO (`data`), tensor and sequence
parallel (`tensor`), expert parallel (`expert`), context parallel (`context`), pipeline parallel (`pipeline`,
its schedules in `schedules`), recompute (`recompute`), applied in order by `parallelize`, driven by
`ParallelEngine` (`PipelineEngine` when pp > 1).

This module also starts processes: `launch` runs `fivefold train` (or `bench`) on N local processes through PyTorch's
own launcher (`torch.distributed.run`, the code behind `torchrun`), `init_distributed` joins the process
group in each of them (gloo on CPU, the accelerator's backend, e.g. nccl, on GPU), and
`write_slurm_script` writes a batch script that runs the same command under `torchrun` on many nodes.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.config import ConfigError
from fivefold.faults import DEFAULT_COLLECTIVE_TIMEOUT_S, die_with_parent, start_watchdog
from fivefold.parallel.engine import ParallelEngine, create_parallel_engine
from fivefold.parallel.mesh import ProcessGrid, validate_layout

__all__ = ["ParallelEngine", "ProcessGrid", "create_parallel_engine", "init_distributed", "launch",
           "local_device", "validate_layout", "write_slurm_script"]


def local_device(device_type: str) -> torch.device:
    """This process's device: the accelerator numbered LOCAL_RANK on its node, or the CPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(device_type: str, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
    """Join the process group that the launcher described in the environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): gloo on CPU, the accelerator's default backend (nccl on CUDA) otherwise. This process dies
    with its launcher, a collective waits at most `timeout_s`, and a watchdog ends the job when a rank stalls
    (see `fivefold.faults`)."""
    if dist.is_initialized():
        return
    die_with_parent()
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = local_device(device_type)
        torch.accelerator.set_device_index(device.index)
        dist.init_process_group(dist.get_default_backend_for_device(device), device_id=device, timeout=timeout)
    start_watchdog(dist.get_rank(), dist.get_world_size(), timeout_s)


def launch(nproc: int, argv: list[str], verb: str = "train") -> int:
    """Run `fivefold VERB ARGV` (train or bench) on `nproc` local processes (single node, a free rendezvous
    port); returns the exit status (non-zero when any process failed)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), "--module", "fivefold", verb, *argv]
    )
    try:
        run(args)
    except ChildFailedError as e:
        print(f"fivefold: {len(e.failures)} of {nproc} processes failed; see their messages above",
              file=sys.stderr)
        return 1
    except SignalException as e:  # SIGTERM/SIGINT/SIGHUP of the launcher: the agent stopped the workers
        print(f"fivefold: stopped by {signal.Signals(e.sigval).name}; the {nproc} processes were stopped",
              file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        print(f"fivefold: interrupted; the {nproc} processes were stopped", file=sys.stderr)
        return 130
    return 0


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9._:/%+=@-]+")


def write_slurm_script(path: str | Path, argv: list[str], nodes: int, gpus_per_node: int,
                       job_name: str = "fivefold", time_limit: str = "01:00:00", port: int = 29500,
                       verb: str = "train", output: str = "%x-%j.out", on_exit: str = "") -> Path:
    """Write a SLURM batch script that runs `fivefold VERB ARGV` on `nodes` x `gpus_per_node` processes: one
    `torchrun` per node (started by `srun`), meeting at the first node through the c10d rendezvous. `on_exit`
    is a shell command run when the script ends, whatever its exit status (`$status` holds it)."""
    for what, value in (("job name", job_name), ("time limit", time_limit), ("output", output), ("verb", verb),
                        *(("argument", a) for a in argv)):
        if _CONTROL.search(str(value)):
            raise ConfigError(f"SLURM script {what} {str(value)!r} holds a control character (newline, ...)")
    for what, value in (("job name", job_name), ("time limit", time_limit), ("output", output)):
        if not _SBATCH_SAFE.fullmatch(value):  # #SBATCH lines are not shell: no quoting exists there
            raise ConfigError(f"SLURM script {what} {value!r} may hold only letters, digits and . _ - : / % +")
    command = " ".join(shlex.quote(a) for a in argv)
    trap = f"trap {shlex.quote(f'status=$?; {on_exit}')} EXIT\n" if on_exit else ""
    text = f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={int(nodes)}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={int(gpus_per_node)}
#SBATCH --exclusive
#SBATCH --time={time_limit}
#SBATCH --output={output}
# Written by fivefold: `fivefold {verb}` under one torchrun per node, each starting {gpus_per_node} ranks.
set -euo pipefail
{trap}head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun \\
  --nnodes "$SLURM_NNODES" --nproc-per-node {gpus_per_node} \\
  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:{int(port)}" \\
  --module fivefold {shlex.quote(verb)} {command}
"""
    path = Path(path)
    path.write_text(text)
    path.chmod(0o755)
    return path
