"""`fivefold sweep GRID.toml --results FILE`: expand a grid, run every valid layout, record every run."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import TextIO

from fivefold import faults
from fivefold.config import ConfigError, check_writable_dir, finite_float, int_in, shown
from fivefold.errors import CliError
from fivefold.outputs import check_target
from fivefold.sweep.grid import PlannedRun, config_json, expand, load_grid
from fivefold.sweep.runner import (
    KeyLock,
    Outcome,
    check_local,
    hostname,
    run_local,
    slurm_outcome,
    slurm_shape,
    submit,
    write_job,
)
from fivefold.sweep.store import STATUSES, Store, StoreError

RETRYABLE = ("oom", "crash", "timeout")
GPUS_PER_NODE = 8  # --gpus-per-node by default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", help="grid file (TOML; see docs/sweeps.md)")
    p.add_argument("--results", required=True, help="SQLite results store (created, or resumed from)")
    p.add_argument("--runs", help="folder of the runs' configs and logs (default: RESULTS without its suffix, "
                                  "plus -runs)")
    p.add_argument("--nproc-max", type=int_in(0, 4096, "local processes"), default=0,
                   help="skip runs that need more local processes than this (default: none skipped, and a grid "
                        "with CPU runs of more than 2 processes per core, at least 4, is refused; a run on more "
                        "processes than this machine's accelerators is refused either way)")
    p.add_argument("--timeout", type=finite_float, help="seconds per run (default: the grid's timeout, else 600)")
    p.add_argument("--hardware", help="hardware profile for the planner's predictions (TOML, as for `fivefold "
                                      "plan --hardware`; default: the built-in profile of the device kind)")
    p.add_argument("--retry", default="", help="re-run stored runs with these statuses, e.g. crash,timeout "
                                               "(invalid runs are always checked again)")
    p.add_argument("--dry-run", action="store_true", help="list what would run, run nothing")
    p.add_argument("--slurm", metavar="DIR", help="write one SLURM batch script per run into DIR (on a shared "
                                                  "filesystem) instead of running locally; run the same command "
                                                  "again to record the jobs that ended")
    p.add_argument("--submit", action="store_true", help="with --slurm: submit the written scripts with sbatch")
    p.add_argument("--gpus-per-node", type=int_in(1, 1024, "devices of one node"),
                   help=f"with --slurm: devices per node (default {GPUS_PER_NODE})")


class Progress:
    """Done / failed / remaining and an ETA; one line per finished run, and on a terminal a live line for the
    run in flight."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.done = self.failed = 0
        self.walls: list[float] = []
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.current = ""

    def eta(self) -> str:
        left = self.total - self.done
        if not self.walls or not left:
            return "-"
        s = sum(self.walls) / len(self.walls) * left
        return f"{int(s // 60)}m{int(s % 60):02d}s"

    def _counts(self) -> str:
        return f"done {self.done}, failed {self.failed}, left {self.total - self.done}, ETA {self.eta()}"

    def start(self, plan: PlannedRun) -> None:
        self.current = plan.label

    def tick(self, elapsed: float) -> None:
        if self.tty:
            self.stream.write(f"\r\033[K[{self.done + 1:>3}/{self.total}] running {elapsed:5.0f} s  "
                              f"{self.current}  | {self._counts()}")
            self.stream.flush()

    def finish(self, plan: PlannedRun, row: dict, wall: float) -> None:
        self.done += 1
        self.failed += row["status"] != "ok"
        if math.isfinite(wall):
            self.walls.append(wall)
        if row["status"] == "ok":
            pred = row.get("predicted_step_time_s")
            vs = f" (pred {pred:.3f}, {100 * (pred / row['step_time_s'] - 1):+.0f} %)" if pred else ""
            mfu = f"  MFU {100 * row['mfu']:.1f} %" if row.get("mfu") is not None else ""
            what = (f"{row['step_time_s']:.3f} s/step{vs}  {row['tokens_per_s_per_device']:,.0f} tok/s/dev{mfu}  "
                    f"mem {row['peak_memory_bytes'] / 2**20:,.0f} MiB")
        else:
            what = row.get("error") or ""
        prefix = "\r\033[K" if self.tty else ""
        self.stream.write(f"{prefix}[{self.done:>3}/{self.total}] {row['status']:<7} {wall:6.1f} s  {plan.label}  "
                          f"{what}  | {self._counts()}\n")
        self.stream.flush()


def make_row(plan: PlannedRun, sweep: str, steps: int, warmup: int, outcome: Outcome, prediction: dict | None,
             hardware, nodes: int) -> dict:
    """The store row of a finished (or invalid) run."""
    cfg, la = plan.cfg, plan.cfg.layout
    row = {
        "key": plan.key, "sweep": sweep, "label": plan.label, "model": plan.model, "status": outcome.status,
        "error": outcome.error, "error_tail": outcome.error_tail, "n_devices": plan.n_devices, "nodes": nodes,
        "dp": la.dp, "tp": la.tp, "pp": la.pp, "cp": la.cp, "ep": la.ep, "zero": la.zero,
        "micro_batch_size": plan.micro_batch_size, "grad_accum_steps": plan.grad_accum_steps, "recompute": la.recompute,
        "sp": int(la.sp), "schedule": la.schedule, "vpp": la.vpp, "seq_len": cfg.train.seq_len,
        "global_batch_size": cfg.train.global_batch_size, "config": config_json(cfg), "steps": steps,
        "warmup": warmup, "host": hostname(), "started_at": outcome.started_at, "finished_at": outcome.finished_at,
        "wall_s": outcome.wall_s if math.isfinite(outcome.wall_s) else None,
    }
    if prediction is not None:
        row.update(predicted_step_time_s=prediction["step_time_s"],
                   predicted_tokens_per_s_per_device=prediction["tokens_per_s_per_device"],
                   predicted_mfu=prediction["mfu"], predicted_peak_memory_bytes=prediction["peak_memory_bytes"],
                   predicted_fits=int(prediction["fits"]), prediction=prediction, hardware=prediction["hardware"])
    r = outcome.result
    if r is not None:
        peak = r.get("peak_tflops")
        mfu = r.get("mfu")
        # no known peak for this device, or a CPU (whose peak is the profile's, calibrated or the nominal one)
        if hardware is not None and (mfu is None or str(r.get("device", "")).startswith("cpu")):
            peak = hardware.peak_flops("bf16" if r["dtype"] == "bf16" else "fp32") / 1e12
            mfu = r["tflops_per_device"] / peak
        split = r.get("time_split_s") or {}
        row.update(step_time_s=r["step_time_s"], tokens_per_s=r["tokens_per_s"],
                   tokens_per_s_per_device=r["tokens_per_s_per_device"], tflops_per_device=r["tflops_per_device"],
                   mfu=mfu, peak_tflops=peak, forward_s=split.get("forward"), backward_s=split.get("backward"),
                   optimizer_s=split.get("optimizer"), peak_memory_bytes=max(r["peak_memory_bytes_per_rank"]),
                   peak_memory_per_rank=r["peak_memory_bytes_per_rank"], memory_source=r.get("memory_source"),
                   device=r.get("device"), device_name=r.get("device_name"), torch=r.get("torch"))
    return row


def _predict(plan: PlannedRun, hardware, device_type: str | None) -> dict | None:
    from fivefold.planner.predict import predict_run

    try:
        return predict_run(plan.cfg, hardware, device_type)
    except (ConfigError, ValueError, ZeroDivisionError) as e:  # a layout the planner does not model
        print(f"fivefold sweep: no prediction for {plan.label}: {e}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    from fivefold.device import resolve_device
    from fivefold.planner.predict import load_hardware, on_one_node

    if args.gpus_per_node is not None and not args.slurm:
        raise CliError(f"--gpus-per-node {args.gpus_per_node} describes the nodes of a SLURM cluster and needs "
                       "--slurm DIR; local runs use this machine's devices (limit their processes with --nproc-max)")
    grid = load_grid(args.grid)
    timeout = args.timeout if args.timeout is not None else grid.timeout
    if timeout <= 0:
        raise ConfigError(f"--timeout = {timeout} must be > 0 seconds")
    retry = tuple(s for s in args.retry.split(",") if s)
    for s in retry:
        if s not in RETRYABLE:
            raise ConfigError(f"--retry {shown(s)} is not one of {', '.join(RETRYABLE)}")
    if args.submit and not args.slurm:
        raise CliError("--submit needs --slurm DIR")
    if args.gpus_per_node is None:
        args.gpus_per_node = GPUS_PER_NODE
    if args.nproc_max < 0 or args.gpus_per_node < 1:
        raise ConfigError(f"--nproc-max = {args.nproc_max} must be >= 0 and --gpus-per-node = "
                          f"{args.gpus_per_node} >= 1")
    plans, dropped = expand(grid)
    if all(p.invalid is not None for p in plans):  # nothing can run: say why, before any file is made
        raise CliError(f"{shown(args.grid)}: none of the grid's combinations can run: {_why_none(plans, dropped)}")
    if not args.slurm:  # the devices and processes the local runs need, before anything runs (a job runs elsewhere)
        check_local(plans, args.nproc_max)
    for note in grid.notes:
        print(f"fivefold sweep: note: {note}", file=sys.stderr)
    results = check_target(args.results, "--results", "results.db")  # a new store, or one to resume
    for flag, folder in (("--slurm", args.slurm), ("--runs", args.runs)):  # the runs' folder, made and writable
        if folder is not None:
            check_writable_dir(folder, flag)
    runs = Path(args.slurm or args.runs or results.with_name(results.stem + "-runs"))
    slurm = args.slurm is not None
    if args.slurm is None and args.runs is None:
        check_writable_dir(runs, "--runs")  # by default beside the store
    # the device kind the runs will use: this machine's, or an accelerator on the SLURM cluster
    device_type = "accelerator" if slurm else None
    hardware = load_hardware(args.hardware, resolve_device("auto").type if not slurm else "accelerator")
    if slurm:
        hardware = dataclasses.replace(hardware, gpus_per_node=args.gpus_per_node)
    else:  # local runs share this one node
        hardware = on_one_node(hardware, max(p.n_devices for p in plans))
    try:
        if not args.dry_run:
            store = Store(results)
        elif results.exists():
            store = Store(results, read_only=True)  # list the plan; the store is left as it is
        else:
            store = Store(":memory:")  # list the plan without creating the store
    except (StoreError, OSError) as e:
        raise CliError(str(e)) from None
    with store:
        return _sweep(args, grid, plans, dropped, store, runs, timeout, retry, hardware, device_type, slurm)


_REPLACEABLE = ("invalid", "interrupted")  # statuses a sweep always runs again


def _why_none(plans: list[PlannedRun], dropped: dict[str, int]) -> str:
    """Why a grid has no run that can run: its dropped combinations and invalid layouts, counted by reason."""
    reasons = dict(dropped)
    for plan in plans:
        reasons[plan.invalid or ""] = reasons.get(plan.invalid or "", 0) + 1
    return "; ".join(f"{reason} ({n} combination{'s' * (n != 1)})"
                     for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))


def _interrupted() -> Outcome:
    from fivefold.sweep.runner import _now

    return Outcome("interrupted", None, "the sweep stopped before this run ended", None, float("nan"), _now(), "")


def _recorded(status: str | None, retry: tuple[str, ...]) -> bool:
    """A run that the store holds and that is not to be run again."""
    return status is not None and status not in _REPLACEABLE and status not in retry


def _sweep(args, grid, plans: list[PlannedRun], dropped: dict[str, int], store: Store, runs: Path, timeout: float,
           retry: tuple[str, ...], hardware, device_type, slurm: bool) -> int:
    out = sys.stdout
    stored = store.statuses()
    todo: list[PlannedRun] = []
    invalid: list[PlannedRun] = []
    too_big: list[PlannedRun] = []
    done = 0
    for plan in plans:
        if _recorded(stored.get(plan.key), retry):
            done += 1
        elif plan.invalid is not None:
            invalid.append(plan)
        elif not slurm and args.nproc_max and plan.n_devices > args.nproc_max:
            too_big.append(plan)
        elif slurm and slurm_shape(plan.n_devices, args.gpus_per_node) is None:
            too_big.append(plan)
        else:
            todo.append(plan)
    why = f"not whole nodes of {args.gpus_per_node}" if slurm else f"more than --nproc-max {args.nproc_max}"
    print(f"fivefold sweep {grid.name}: {len(plans)} runs in the grid; {done} already in {args.results}, "
          f"{len(invalid)} invalid, " + (f"{len(too_big)} skipped ({why}), " if too_big else "") +
          f"{len(todo)} to run" + (f"; {sum(dropped.values())} combinations dropped" if dropped else ""), file=out)
    for reason, n in sorted(dropped.items(), key=lambda kv: -kv[1]):
        print(f"  dropped ({n} combination{'s' * (n != 1)}): {reason}", file=out)
    for plan in too_big:
        print(f"  skipped: {plan.label} needs {plan.n_devices} processes", file=out)
    by_reason: dict[str, list[PlannedRun]] = {}
    for plan in invalid:
        row = make_row(plan, grid.name, grid.steps, grid.warmup,
                       Outcome("invalid", None, plan.invalid, None, float("nan"), "", ""), None, None, 1)
        if args.dry_run or store.record(row, replace_statuses=("invalid",)):
            by_reason.setdefault(plan.invalid or "", []).append(plan)
    for reason, group in by_reason.items():
        example = f"{len(group)} runs, e.g. {group[0].label}" if len(group) > 1 else group[0].label
        print(f"  invalid ({example}): {reason}", file=out)
    if args.dry_run:
        for plan in todo:
            print(f"  would run: {plan.key} {plan.label} on {plan.n_devices} process(es)", file=out)
        return 0
    if slurm:
        return _slurm(args, grid, todo, store, runs, timeout, retry, hardware, device_type)
    progress = Progress(len(todo), out)
    locks = Path(args.results).with_name(Path(args.results).name + ".locks")
    # SIGTERM and SIGHUP stop the run in flight like Ctrl-C does (`faults.StopSignal`, a KeyboardInterrupt), instead
    # of orphaning its processes; the handlers before are restored when the loop ends
    lock: KeyLock | None = None
    flight: PlannedRun | None = None
    try:
        with faults.stop_signals_interrupt():
            for plan in todo:
                lock = KeyLock(locks, plan.key)
                if not lock.acquire():
                    progress.total -= 1
                    print(f"  running in another sweep now, skipped: {plan.label}", file=out)
                    continue
                # another sweep on the same file may have finished it meanwhile
                if _recorded(store.status(plan.key), retry):
                    lock.release()
                    progress.total -= 1
                    print(f"  already recorded by another sweep: {plan.label}", file=out)
                    continue
                prediction = _predict(plan, hardware, device_type)
                progress.start(plan)
                # recorded as interrupted until it ends: a sweep killed meanwhile (even by SIGKILL) leaves it so
                flight = plan
                store.record(make_row(plan, grid.name, grid.steps, grid.warmup, _interrupted(), prediction, hardware,
                                      1), replace_statuses=_REPLACEABLE + retry)
                outcome = run_local(plan, runs, grid.steps, grid.warmup, timeout, progress.tick)
                row = make_row(plan, grid.name, grid.steps, grid.warmup, outcome, prediction, hardware, 1)
                store.record(row, replace_statuses=_REPLACEABLE + retry)
                flight = None
                lock.release()
                progress.finish(plan, row, outcome.wall_s)
    except KeyboardInterrupt:
        lost = f"; {flight.label} is recorded as interrupted" if flight is not None else ""
        print(f"\nfivefold sweep: interrupted; {progress.done} runs recorded in {args.results}{lost}; run the "
              "same command to finish the rest", file=sys.stderr)
        return 130
    finally:
        if lock is not None:
            lock.release()
    _summary(store, grid.name, args.results, out)
    return 0


def _slurm(args, grid, todo: list[PlannedRun], store: Store, runs: Path, timeout: float, retry, hardware,
           device_type) -> int:
    """Record the submitted jobs that ended, write the scripts of the rest, and submit them when asked."""
    out = sys.stdout
    recorded = written = submitted = waiting = 0
    for plan in todo:
        folder = runs / plan.key
        ended = slurm_outcome(folder, timeout) if (folder / "job.sh").exists() else None
        stored = store.row(plan.key)
        # a retried run's old job is not recorded again: only an outcome newer than the stored one
        fresh = ended is not None and (stored is None or stored["finished_at"] != ended.finished_at)
        if fresh:
            nodes = (slurm_shape(plan.n_devices, args.gpus_per_node) or (1, 0))[0]
            row = make_row(plan, grid.name, grid.steps, grid.warmup, ended, _predict(plan, hardware, device_type),
                           hardware, nodes)
            store.record(row, replace_statuses=("invalid", *retry))
            recorded += 1
            print(f"  recorded {row['status']}: {plan.label}", file=out)
            continue
        if not ended and (folder / "job_id").exists():
            waiting += 1
            continue
        (folder / "job_id").unlink(missing_ok=True)
        job = write_job(plan, runs, grid.steps, grid.warmup, timeout, args.gpus_per_node, grid.name)
        written += 1
        if args.submit:
            try:
                job_id = submit(job)
            except (RuntimeError, FileNotFoundError) as e:
                raise CliError(f"{e}; the scripts are in {runs}") from None
            submitted += 1
            print(f"  submitted {job_id}: {plan.label}", file=out)
    hint = "" if args.submit else f"; submit them with --submit (or sbatch {runs}/KEY/job.sh)"
    print(f"fivefold sweep --slurm {runs}: recorded {recorded} ended jobs, wrote {written} scripts, submitted "
          f"{submitted}, {waiting} queued or running{hint}; run the same command again to record the jobs "
          "that end", file=out)
    return 0


def _summary(store: Store, name: str, results: str, out: TextIO) -> None:
    counts = {s: 0 for s in STATUSES}
    for status in store.statuses().values():
        counts[status] = counts.get(status, 0) + 1
    text = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    print(f"fivefold sweep {name}: {results} holds {sum(counts.values())} runs ({text}); "
          f"report: fivefold report {results} --out report/", file=out)
