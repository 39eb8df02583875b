"""Running one planned run, locally or as a SLURM job, and turning what it left into a store row.

Every run has a folder `RUNS/KEY/` holding `config.toml` (the full config), `output.log` (everything its
processes printed) and, when it finished, `result.json` (what `fivefold bench --out` writes). Locally the run is
`fivefold bench --nproc N` in a subprocess of its own session: PyTorch's launcher with a free rendezvous port
(`--standalone`); past the timeout the launcher gets SIGTERM (it stops its workers), and whatever of the run is
still alive after a grace period gets SIGKILL. Under SLURM the same command runs under `torchrun` from a batch
script `RUNS/KEY/job.sh`; the script writes `RUNS/KEY/exit_status` when it ends.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fivefold.config import ConfigError, check_device_name, dump_toml, shown
from fivefold.device import cpu_allocator_env, resolve_device
from fivefold.faults import descendants, preexec_die_with_parent, try_flock
from fivefold.launch import import_path, write_slurm_script
from fivefold.sweep.grid import PlannedRun, config_json

TERM_GRACE_S = 20.0
TAIL_LINES = 15
_ERROR_LINE = re.compile(r"^\s*(\w+(\.\w+)*(Error|Exception)|ChildFailedError|fivefold \w+: error)\b.*", re.M)
_LAUNCHER_NOISE = re.compile(r"^[WI]\d{4} .*(run\.py|api\.py):\d+\]|^\*{5,}$|Setting OMP_NUM_THREADS")


@dataclass
class Outcome:
    """What a run left: its status, the bench result (when ok) and the error's lines (when not)."""

    status: str
    result: dict | None
    error: str | None
    error_tail: str | None
    wall_s: float
    started_at: str
    finished_at: str


class KeyLock:
    """An exclusive lock on one run key (fcntl on `LOCKS/KEY.lock`, released when the process ends, however
    it ends), so two sweeps on the same store never run the same key at once."""

    def __init__(self, locks: Path, key: str) -> None:
        self.path = locks / f"{key}.lock"
        self.fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = try_flock(self.path)
        return self.fd is not None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def run_dir(runs: Path, plan: PlannedRun) -> Path:
    return runs / plan.key


def bench_argv(plan: PlannedRun, folder: Path, steps: int, warmup: int) -> list[str]:
    """`fivefold bench` arguments of this run (the process count is the launcher's business)."""
    return ["--config", str(folder / "config.toml"), "--micro-batch", str(plan.micro_batch_size),
            "--grad-accum", str(plan.grad_accum_steps), "--steps", str(steps), "--warmup", str(warmup),
            "--out", str(folder / "result.json")]


def prepare(runs: Path, plan: PlannedRun) -> Path:
    folder = run_dir(runs, plan)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "exit_status"):
        (folder / stale).unlink(missing_ok=True)
    (folder / "config.toml").write_text(f"# fivefold sweep run {plan.key}: {plan.label}\n" + dump_toml(plan.cfg))
    (folder / "config.json").write_text(config_json(plan.cfg) + "\n")
    return folder


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's top process (the launcher stops its workers on it), then SIGKILL to what is left."""
    family = descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        pass
    for pid in [proc.pid, *family, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def subprocess_env(cpu: bool = False, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a run: `base` (default: this process's), with this fivefold first on the import path; for
    a run on the CPU with glibc's thread cache off (`device.cpu_allocator_env`: a run of one process is the process
    started here)."""
    base = os.environ if base is None else base
    env = {**base, "PYTHONPATH": import_path(base.get("PYTHONPATH"))}
    return cpu_allocator_env(env) if cpu else env


def run_local(plan: PlannedRun, runs: Path, steps: int, warmup: int, timeout: float,
              tick: Callable[[float], None] | None = None) -> Outcome:
    """Run one planned run as its own process group and wait for it (at most `timeout` seconds)."""
    folder = prepare(runs, plan)
    cmd = [sys.executable, "-m", "fivefold", "bench", "--nproc", str(plan.n_devices),
           *bench_argv(plan, folder, steps, warmup)]
    started, t0 = _now(), time.monotonic()
    timed_out = False
    with open(folder / "output.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=subprocess_env(resolve_device(plan.cfg.train.device).type == "cpu"),
                                start_new_session=True,
                                preexec_fn=preexec_die_with_parent)  # a killed sweep takes its run down
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - t0
                if elapsed > timeout:
                    timed_out = True
                    _stop(proc)
                    break
                if tick is not None:
                    tick(elapsed)
                time.sleep(0.2)
        except BaseException:  # Ctrl-C or a kill of the sweep: take the run down with it
            _stop(proc)
            raise
    wall = time.monotonic() - t0
    return outcome_of(folder, proc.returncode, timed_out, timeout, wall, started, _now())


def outcome_of(folder: Path, returncode: int | None, timed_out: bool, timeout: float, wall: float,
               started: str, finished: str) -> Outcome:
    """Classify a finished run from its exit status, its output and its result file."""
    import json

    log = (folder / "output.log").read_text(errors="replace") if (folder / "output.log").exists() else ""
    result_file = folder / "result.json"
    if not timed_out and returncode == 0 and result_file.exists():
        return Outcome("ok", json.loads(result_file.read_text()), None, None, wall, started, finished)
    lines = [ln for ln in log.splitlines() if ln.strip() and not _LAUNCHER_NOISE.search(ln)]
    tail = "\n".join(lines[-TAIL_LINES:])
    if timed_out or "DUE TO TIME LIMIT" in log:
        return Outcome("timeout", None, f"timed out after {timeout:.0f} s", tail, wall, started, finished)
    errors = [m.group(0).strip() for m in _ERROR_LINE.finditer(log)]
    specific = [e for e in errors if not e.startswith("ChildFailedError")]
    message = (specific or errors or [f"exit status {returncode} without an error message"])[-1]
    status = "oom" if re.search(r"out of memory|OutOfMemoryError", log, re.I) else "crash"
    if status == "oom":
        message = next((e for e in reversed(specific) if re.search(r"out of memory", e, re.I)), message)
    return Outcome(status, None, message[:500], tail, wall, started, finished)


def check_local(plans: list[PlannedRun], nproc_max: int) -> None:
    """What the runs that a local sweep would start need of this machine, checked before any of them starts: each
    grid's `train.device` present here (`present_device`, the check of `fivefold train` and `fivefold calibrate
    --device`), no accelerator run on more processes than this machine has devices of its kind (one process per
    device), and, without `--nproc-max`, no CPU run on more processes than `max_cpu_processes` (with it, the runs
    above it are skipped instead, and only those it keeps are checked). Invalid runs are never started and not
    checked."""
    from fivefold.device import (
        CPU_PROCESSES_MIN,
        CPU_PROCESSES_PER_CORE,
        available_cores,
        max_cpu_processes,
        present_device,
    )

    valid = [p for p in plans if p.invalid is None]
    kinds: dict[str, str] = {}
    for name in dict.fromkeys(p.cfg.train.device for p in valid):
        check_device_name(name, "grid train.device")  # a name PyTorch does not know is no device anywhere
        try:
            kinds[name] = present_device(name, "grid train.device").type
        except ConfigError as e:
            raise ConfigError(f"{e}; or write the runs as SLURM jobs for a cluster that has it (--slurm DIR)") from None
    kept = [p for p in valid if not nproc_max or p.n_devices <= nproc_max]  # --nproc-max skips the others
    accelerated = [p for p in kept if kinds[p.cfg.train.device] != "cpu"]
    if accelerated:
        import torch

        count = torch.accelerator.device_count()
        over = [p for p in accelerated if p.n_devices > count]
        if over:
            big = max(over, key=lambda p: p.n_devices)
            kind = kinds[big.cfg.train.device]
            raise ConfigError(f"{len(over)} run(s) of the grid need more processes than this machine's {count} {kind} "
                              f"device(s) (a local run starts one process per device), e.g. {big.label} with grid "
                              f"train.device = {shown(big.cfg.train.device)} on {big.n_devices}; give at most "
                              f"{count} devices, or --nproc-max {count} to skip the runs above {count} processes, or "
                              "write the runs as SLURM jobs for a cluster that has them (--slurm DIR)")
    if nproc_max:
        return
    bound = max_cpu_processes()
    over = [p for p in valid if kinds[p.cfg.train.device] == "cpu" and p.n_devices > bound]
    if over:
        big = max(over, key=lambda p: p.n_devices)
        raise ConfigError(f"{len(over)} run(s) of the grid need more local CPU processes than this machine's "
                          f"{available_cores()} cores sensibly run (at most {bound}: {CPU_PROCESSES_PER_CORE} per "
                          f"core, at least {CPU_PROCESSES_MIN}), e.g. {big.label} on {big.n_devices}; give fewer "
                          f"devices, or --nproc-max N to skip the runs above N processes (--nproc-max "
                          f"{big.n_devices} runs them all)")


# ---------------------------------------------------------------------------------------------
# SLURM


def slurm_shape(n_devices: int, gpus_per_node: int) -> tuple[int, int] | None:
    """(nodes, processes per node) of a run, or None when it does not fill whole nodes."""
    if n_devices <= gpus_per_node:
        return 1, n_devices
    if n_devices % gpus_per_node:
        return None
    return n_devices // gpus_per_node, gpus_per_node


def write_job(plan: PlannedRun, runs: Path, steps: int, warmup: int, timeout: float, gpus_per_node: int,
              sweep: str) -> Path:
    """Write `RUNS/KEY/job.sh` (and the run's config); the caller checked `slurm_shape`."""
    folder = prepare(runs, plan).resolve()
    nodes, per_node = slurm_shape(plan.n_devices, gpus_per_node) or (1, plan.n_devices)
    minutes = max(1, math.ceil(timeout / 60))
    port = 29500 + int(plan.key[:4], 16) % 2000  # distinct jobs sharing a node get distinct ports
    return write_slurm_script(
        folder / "job.sh", bench_argv(plan, folder, steps, warmup), nodes, per_node,
        job_name=re.sub(r"[^A-Za-z0-9._-]", "_", f"{sweep}-{plan.key[:8]}"),
        time_limit=f"{minutes // 60:02d}:{minutes % 60:02d}:00", port=port, verb="bench",
        output=str(folder / "output.log"), on_exit=f"echo $status > {shlex.quote(str(folder / 'exit_status'))}",
        gpus=not is_cpu_device(plan.cfg.train.device))


def is_cpu_device(name: str) -> bool:
    """Whether `train.device` names the CPU itself (`auto` is the accelerator of the node the job lands on)."""
    return name.split(":", 1)[0] == "cpu"


def submit(job: Path) -> str:
    """`sbatch JOB`; returns the job id (also written beside the script)."""
    done = subprocess.run(["sbatch", str(job)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {job} failed: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split()[-1]
    (job.parent / "job_id").write_text(job_id + "\n")
    return job_id


def slurm_outcome(folder: Path, timeout: float) -> Outcome | None:
    """The outcome of a SLURM run that has ended, or None while it is pending or running."""
    exit_file, log = folder / "exit_status", folder / "output.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    timed_out = "DUE TO TIME LIMIT" in text
    if not exit_file.exists() and not timed_out:
        return None
    code = int(exit_file.read_text().strip() or 1) if exit_file.exists() else None
    mtime = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime((exit_file if exit_file.exists() else log)
                                                             .stat().st_mtime))
    return outcome_of(folder, code, timed_out, timeout, float("nan"), "", mtime)


def hostname() -> str:
    return socket.gethostname()
