"""The one launcher: how `fivefold train`, `bench`, `sweep` and `calibrate` start and join processes.

`launch` runs `fivefold train` (or `bench`) on N local processes through PyTorch's
own launcher (`torch.distributed.run`, the code behind `torchrun`), `init_distributed` joins the process
group in each of them (gloo on CPU, the accelerator's backend, e.g. nccl, on GPU), and
`write_slurm_script` writes a batch script that runs the same command under `torchrun` on many nodes.
`start_or_join` either starts the local processes or joins the launcher's group from inside one of them; the
command line has checked the layout before (`fivefold.layout.check_layout`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.config import Config, ConfigError, shown
from fivefold.device import cpu_allocator_env, local_device, resolve_device
from fivefold.faults import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    FAILURES_DIR_ENV,
    RunLock,
    SaveAbandoned,
    descendants,
    die_with_parent,
    first_failure,
    quiet_hung_up_terminal,
    start_watchdog,
    wait_for_ranks,
)

__all__ = ["init_distributed", "launch", "local_world_size", "start_or_join", "write_slurm_script"]


def local_world_size(nproc: int) -> int:
    """Processes of a local run: those of the group a launcher started this one in, else the `nproc` to start."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    return launched if launched > 1 else max(nproc, 1)


def start_or_join(cfg: Config, nproc: int, argv: list[str], verb: str) -> int | None:
    """Outside a launcher with `nproc` > 1: run `fivefold VERB ARGV` on `nproc` local processes and return their
    exit status. In a process a launcher started: join its process group and return None, as on one process
    (the caller goes on)."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if nproc > 1 and not launched:
        return launch(nproc, argv, verb=verb, run_dir=Path(cfg.run_dir) if verb == "train" else None,
                      cpu=resolve_device(cfg.train.device).type == "cpu")
    if launched:
        init_distributed(resolve_device(cfg.train.device).type, cfg.train.collective_timeout_s)
        if verb == "train":
            agree_on_run_dir(cfg)
    return None


def agree_on_run_dir(cfg: Config) -> None:
    """Under `torchrun` without `--run-dir` each rank names its own default run directory (`runs/NAME-TIME`, to
    the second), and ranks that started a second apart wrote into two directories, one that rank 0 never created:
    the checkpoint failed (ENOENT). Rank 0's directory is the run's (one broadcast, before anything is written);
    with `--run-dir`, or under `--nproc` (whose launcher forwards its own), the ranks already agree."""
    box = [cfg.run_dir]
    dist.broadcast_object_list(box, src=0)
    cfg.run_dir = box[0]


def init_distributed(device_type: str, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
    """Join the process group that the launcher described in the environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): gloo on CPU, the accelerator's default backend (nccl on CUDA) otherwise. This process dies
    with its launcher, a collective waits at most `timeout_s`, and a watchdog ends the job when a rank stalls
    (see `fivefold.faults`)."""
    if dist.is_initialized():
        return
    die_with_parent()
    wait_for_ranks(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), timeout_s)
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cpu":
        dist.init_process_group("gloo", timeout=timeout)
    else:
        device = local_device(device_type)
        torch.accelerator.set_device_index(device.index)
        dist.init_process_group(dist.get_default_backend_for_device(device), device_id=device, timeout=timeout)
    start_watchdog(dist.get_rank(), dist.get_world_size(), timeout_s)


def finish_distributed() -> None:
    """Leave the process group at the end of a run that every rank completed: wait for all of them (so that none
    closes its connections while another still talks to it), then destroy the groups while the interpreter is
    whole. Left to interpreter exit, gloo's worker threads may still hold tensors of asynchronous work (ZeRO-3's
    gathers and reduce-scatters) when Python finalises, and the process aborts with "terminate called without an
    active exception" (pytorch/pytorch#190489), failing a run that had finished."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(nproc: int, argv: list[str], verb: str = "train", run_dir: Path | None = None, cpu: bool = False) -> int:
    """Run `fivefold VERB ARGV` (train or bench) on `nproc` local processes (single node, a free rendezvous
    port); returns the exit status (non-zero when any process failed). With `run_dir` (a training run) the launcher
    owns the run directory for its workers: it holds its lock (`faults.RunLock`) from before the first worker starts
    until the last one has exited.

    SIGTERM, SIGINT and SIGHUP of the launcher are forwarded to the workers by PyTorch's agent, which waits for
    them (they finish their step, write a checkpoint and exit with 128 + the signal's number); a second signal
    while it waits kills them and raises `faults.SaveAbandoned`. `cpu`: the workers run on the CPU, with glibc's
    thread cache off (`device.cpu_allocator_env`)."""
    with RunLock(run_dir) if run_dir is not None else contextlib.nullcontext():
        return run_workers(nproc, argv, verb, cpu)


# The lines in which PyTorch's agent announces a stop ("Received 2 death signal, shutting down workers", "Sending
# process 1812 closing signal SIGINT"), by logger and message template: on Ctrl-C, SIGTERM or SIGHUP the ranks say
# what they saved and how to resume, and `run_workers` that the processes were stopped, in fivefold's words. Its
# other lines (a worker that would not stop and was killed, a failure) are kept.
AGENT_STOP_LINES = {
    "torch.distributed.elastic.agent.server.api": frozenset({"Received %s death signal, shutting down workers"}),
    "torch.distributed.elastic.multiprocessing.api": frozenset({"Sending process %s closing signal %s"}),
}


class DropLines(logging.Filter):
    """Drops the records of a logger whose message template is one of `templates`."""

    def __init__(self, templates: frozenset[str]) -> None:
        super().__init__()
        self.templates = templates

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.templates


@contextlib.contextmanager
def quiet_agent_stops():
    """While PyTorch's agent runs the workers: without its announcements of a stop (`AGENT_STOP_LINES`)."""
    filters = [(logging.getLogger(name), DropLines(templates)) for name, templates in AGENT_STOP_LINES.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


def run_workers(nproc: int, argv: list[str], verb: str, cpu: bool = False) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), "--module", "fivefold", verb, *argv]
    )
    failures = tempfile.mkdtemp(prefix="fivefold-failures-")
    workers = {FAILURES_DIR_ENV: failures}  # each worker leaves its one-line error there (faults.record_failure)
    if "OMP_NUM_THREADS" not in os.environ:  # each worker's share of the cores, as it sets its intra-op threads
        from fivefold.device import default_threads  # (PyTorch's launcher would set 1 and print a banner saying so)

        workers["OMP_NUM_THREADS"] = str(default_threads(nproc))
    if cpu and "GLIBC_TUNABLES" in (allocator := cpu_allocator_env(os.environ)):
        workers["GLIBC_TUNABLES"] = allocator["GLIBC_TUNABLES"]
    try:
        with environment(workers), quiet_agent_stops():  # the workers inherit this process's environment
            run(args)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        first = first_failure(failures, codes) or (e.get_first_failure()[0], "see its messages above")
        print(f"fivefold: rank {first[0]} failed first: {first[1]} ({len(e.failures)} of {nproc} processes "
              "failed)", file=sys.stderr)
        code = codes.get(first[0], e.get_first_failure()[1].exitcode)  # e.g. 3 after non-finite steps: kept
        return code if code > 0 else 1
    except SignalException as e:  # SIGTERM/SIGINT/SIGHUP of the launcher: the agent stopped the workers
        if e.sigval == signal.SIGHUP:
            quiet_hung_up_terminal()
        if isinstance(e.__context__, SignalException):  # raised while the agent waited on the first signal
            for pid in descendants(os.getpid()):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            raise SaveAbandoned(int(e.sigval)) from None
        print(f"fivefold: stopped by {signal.Signals(e.sigval).name}; the {nproc} processes were stopped",
              file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        print(f"fivefold: interrupted; the {nproc} processes were stopped", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(failures, ignore_errors=True)
    return 0


def import_path(current: str | None) -> str:
    """PYTHONPATH for a process started from this one: this fivefold's directory first (the package may be on this
    process's path only, as under pytest), then `current`."""
    here = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([here, *([current] if current else [])])


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `values` set for the block only (the processes started in it inherit them): each variable
    back to its value before, or unset, afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9._:/%+=@-]+")


def write_slurm_script(path: str | Path, argv: list[str], nodes: int, gpus_per_node: int,
                       job_name: str = "fivefold", time_limit: str = "01:00:00", port: int = 29500,
                       verb: str = "train", output: str = "%x-%j.out", on_exit: str = "",
                       partition: str | None = None, account: str | None = None, setup: str | None = None,
                       gpus: bool = True) -> Path:
    """Write a SLURM batch script that runs `fivefold VERB ARGV` on `nodes` x `gpus_per_node` processes: one
    `torchrun` per node (started by `srun`), meeting at the first node through the c10d rendezvous. `on_exit`
    is a shell command run when the script ends, whatever its exit status (`$status` holds it); `setup` a shell
    file sourced first (modules, environment, NCCL settings). `gpus`: the job asks for `gpus_per_node` GPUs per
    node (`#SBATCH --gpus-per-node`); a CPU job (false) asks for none and runs as many processes per node.

    SLURM sends SIGTERM to the script 120 s before the time limit (`--signal=B:TERM@120`); the script forwards it
    to `srun`, which passes it to each `torchrun`, which passes it to its ranks: they finish their step, write a
    checkpoint and exit with 143 (`fivefold train --resume` continues). torchrun kills ranks that have not
    exited 30 s after forwarding the signal, so a checkpoint must take less than that."""
    sbatch = (("job name", job_name), ("time limit", time_limit), ("output", output), ("partition", partition or ""),
              ("account", account or ""))
    for what, value in (*sbatch, ("verb", verb), ("set-up file", setup or ""), *(("argument", a) for a in argv)):
        if _CONTROL.search(str(value)):
            raise ConfigError(f"SLURM script {what} {shown(str(value))} holds a control character (newline, ...)")
    for what, value in sbatch:
        if value and not _SBATCH_SAFE.fullmatch(value):  # #SBATCH lines are not shell: no quoting exists there
            raise ConfigError(f"SLURM script {what} {shown(value)} may hold only letters, digits and . _ - : / % + = @")
    command = " ".join(shlex.quote(a) for a in argv)
    trap = f"trap {shlex.quote(f'status=$?; {on_exit}')} EXIT\n" if on_exit else ""
    options = "".join(f"#SBATCH --{k}={v}\n" for k, v in (("partition", partition), ("account", account)) if v)
    # sourced before `set -u`: set-up files often read unset variables; srun passes the environment to the nodes
    source = f"source {shlex.quote(setup)}\n" if setup else ""
    gpu_line = f"#SBATCH --gpus-per-node={int(gpus_per_node)}\n" if gpus else ""
    text = f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={int(nodes)}
#SBATCH --ntasks-per-node=1
{gpu_line}#SBATCH --exclusive
#SBATCH --time={time_limit}
#SBATCH --output={output}
#SBATCH --signal=B:TERM@120
{options}# Written by fivefold: `fivefold {verb}` under one torchrun per node, each starting {gpus_per_node} ranks.
{source}set -euo pipefail
{trap}head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun \\
  --nnodes "$SLURM_NNODES" --nproc-per-node {gpus_per_node} \\
  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:{int(port)}" \\
  --module fivefold {shlex.quote(verb)} {command} &
job=$!
# SIGTERM ahead of the time limit (or scancel --signal=TERM -b): the ranks checkpoint and exit (code 143)
trap 'echo "fivefold: SIGTERM, asking the ranks to write a checkpoint and stop" >&2; kill -TERM "$job"' TERM
code=0
wait "$job" || code=$?
while kill -0 "$job" 2>/dev/null; do wait "$job" || code=$?; done  # a trapped signal ends the first wait early
exit "$code"
"""
    path = Path(path)
    path.write_text(text)
    path.chmod(0o755)
    return path
