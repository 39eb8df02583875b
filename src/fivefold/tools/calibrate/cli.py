"""`fivefold calibrate`'s command line: its arguments, the run over 1..N ranks, the profile written and the
summary printed."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from fivefold.config import ConfigError, int_in
from fivefold.device import cpu_allocator_env, present_device
from fivefold.errors import CliError
from fivefold.outputs import check_target, keep_previous
from fivefold.tools.calibrate.harness import size_text
from fivefold.tools.calibrate.profile import profile_header, profile_name, profile_tables, write_profile
from fivefold.tools.calibrate.ranks import measure_group, worker
from fivefold.tools.calibrate.targets import Plan, Result, for_group, make_plan
from fivefold.tools.calibrate.whole_step import (
    dispatch_us,
    measure_heap_retention,
    predicted_step,
    reference_plan,
    step_scale,
    time_recompute_pair,
    time_whole_step,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="profile to write (default: calibrated-DEVICE.toml)")
    p.add_argument("--device", default="auto", help="cpu, cuda, xpu, ... (default: the accelerator if any, else cpu)")
    p.add_argument("--nproc-max", type=int_in(0, 4096, "local processes"), default=0,
                   help="most ranks to run at once (default: 4 on CPU, the device count on accelerators)")
    p.add_argument("--model", default="",
                   help="comma-separated presets whose shapes to measure (default: tiny on CPU, llama-3.2-1b on GPU)")
    p.add_argument("--seq-len", type=int_in(0, 1 << 20, "tokens per sequence of the measured shapes"),
                   default=0, help="sequence length of those shapes (default: 128 on CPU, 4096 on GPU)")
    p.add_argument("--threads", type=int_in(0, os.cpu_count() or 1, "at most this machine's CPU cores"),
                   default=0, help="CPU: intra-op threads per rank (default 0: each rank's share of the cores with "
                                   "N ranks at once, as `fivefold train` runs by default; 1 for runs with one "
                                   "thread per process, as torchrun sets or a sweep's threads = 1)")
    p.add_argument("--quick", action="store_true",
                   help="a coarse profile in seconds (2 ranks, few shapes and sizes, short timings): for tests")
    # each process that the launcher starts for N ranks: the plan to measure, written by `measure_group`
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)


def calibrate(args: argparse.Namespace) -> tuple[Path, dict[int, Result], float]:
    """Measure with 1..N ranks and write the profile: its path, the figures by rank count, the seconds taken."""
    if args.seq_len < 0:
        raise CliError(f"--seq-len = {args.seq_len} must be >= 1 (or 0 for the default)")
    if args.nproc_max < 0:
        raise CliError(f"--nproc-max = {args.nproc_max} must be >= 1 (or 0 for the default)")
    try:
        device_type = present_device(args.device, "--device").type
    except ConfigError as e:
        raise CliError(str(e)) from None
    plan, levels = make_plan(args, device_type)
    out = check_target(f"calibrated-{device_type}.toml" if args.out is None else args.out, "--out",
                       "calibrated-cpu.toml")  # before the minutes of measuring, not after
    print(f"calibrate: {device_type}, ranks {levels[0]}..{levels[-1]}, {len(plan.linear)} linear, "
          f"{len(plan.attention)} attention and {len(plan.loss)} loss shapes, {len(plan.message_bytes)} message sizes"
          f"{' (quick)' if args.quick else ''}", flush=True)
    start = time.perf_counter()
    load_before = _load_note()
    cores = os.cpu_count() or 1
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5 * cores:
        print(f"calibrate: warning: the machine is busy (load average {load_before} on {cores} cores): the timings "
              "will include the other work, and a profile made now misdescribes the idle machine; calibrate again "
              "when it is idle", flush=True)
    results: dict[int, Result] = {}
    threads: dict[int, int] = {}  # intra-op threads per rank, by ranks at once (CPU)
    scale = None
    for n in levels:
        group = for_group(plan, n)
        results[n], threads[n] = measure_group(group, n), group.threads
        print(f"calibrate: {n} rank{'s' if n > 1 else ''} done in {results[n].seconds:.0f} s", flush=True)
        if n == 1 and device_type == "cpu":  # against its parts timed at the same moment
            scale = whole_step_figures(group, args.quick)
    seconds = time.perf_counter() - start
    load = f"load average {load_before} before, {_load_note()} after (cores: {os.cpu_count()})"
    print(f"calibrate: {load}", flush=True)
    text_header = profile_header(args.quick, socket.gethostname(), device_type, seconds,
                                 time.strftime('%Y-%m-%d %H:%M'), load)
    tables = profile_tables(results, device_type, threads, levels[-1], profile_name(out))
    if scale is not None:
        tables.update(scale)
    if (backup := keep_previous(out)) is not None:  # a profile already there (perhaps edited) is kept, not lost
        print(f"calibrate: kept the previous {out} as {backup}", flush=True)
    write_profile(out, tables, text_header)
    return out, results, seconds


def whole_step_figures(plan: Plan, quick: bool) -> dict[str, float]:
    """The reference model's whole step, on one rank's intra-op threads (`plan.threads`), timed through the engine
    against what its own parts, timed just before and just after it, predict for it: the factor on every compute
    time, `compute_scale`; then the same step under selective recompute: `selective_dispatch_us`; then its resident
    memory in a fresh process against its live tensors: `heap_retention` (`whole_step`)."""
    import dataclasses

    from fivefold.planner.hardware import cluster_from_table

    def say(text: str) -> None:
        print(f"calibrate [1 rank] {text}", flush=True)

    threads = plan.threads
    ref = reference_plan(plan)

    def parts_now():
        """The reference's parts timed now, as a profile of their own."""
        tables = profile_tables({1: measure_group(ref, 1)}, "cpu", {1: threads}, 1, "parts")
        return cluster_from_table(tables, "the reference model's parts")

    steps, warmup = (3, 1) if quick else (30, 5)
    before = parts_now()
    measured = time_whole_step(threads, steps, warmup, say)
    after = parts_now()
    predicted = [predicted_step(c, threads) for c in (before, after)]
    scale = round(step_scale(measured, statistics.fmean(predicted)), 4)
    say(f"its parts, timed just before and after it, predict {1e3 * predicted[0]:.1f} and {1e3 * predicted[1]:.1f} "
        f"ms: compute_scale = {scale}")
    pair = time_recompute_pair(threads, *((2, 2, 1) if quick else (8, 5, 3)), say)
    # without the term being measured (a profile based on the `cpu` preset inherits the preset's)
    scaled = dataclasses.replace(after, compute_scale=scale, selective_dispatch_us=0.0)
    dispatch = dispatch_us(pair, (predicted_step(scaled, threads), predicted_step(scaled, threads, "selective")))
    say(f"selective recompute's policy: {dispatch / 1e3:.2f} ms per block beyond the work it reruns: "
        f"selective_dispatch_us = {dispatch}")
    retention = measure_heap_retention(threads, *((3, 1) if quick else (10, 3)), say)
    return {"compute_scale": scale, "selective_dispatch_us": dispatch, "heap_retention": retention}


def restart_command(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """The command and environment to run this calibration again under the C allocator of the runs it profiles, or
    None where nothing would change. On a Linux CPU the runs fivefold starts (a sweep's, the launcher's ranks) have
    glibc's thread cache off (`device.cpu_allocator_env`), while a calibrate started by hand has it on; its one-rank
    tables, the whole step and the recompute pair are timed in its own process, and the cache changes a step: the
    reference step was 7-8 % slower with it off in the median of 14 alternating pairs of fresh processes (11 of 14
    slower; 2026-11-29, docs/sweeps.md). The tunable is read when a process starts, so the command restarts itself;
    only from the command line (`args.command_line`; a test that calls `main` is left in its process)."""
    from fivefold.sweep.runner import subprocess_env

    if args.worker or not args.command_line:
        return None
    try:
        if present_device(args.device, "--device").type != "cpu":
            return None
    except ConfigError:
        return None  # the calibration itself says what is wrong with the device
    if cpu_allocator_env(env).get("GLIBC_TUNABLES") == env.get("GLIBC_TUNABLES"):
        return None  # set already (by the restart, or by the user), or not Linux
    # this fivefold first on the import path, as for the runs
    return [sys.executable, "-m", "fivefold", *args.command_line], subprocess_env(cpu=True, base=env)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args.worker)
    restart = restart_command(args, os.environ)
    if restart is not None:
        argv, env = restart
        print(f"calibrate: restarting with GLIBC_TUNABLES={env['GLIBC_TUNABLES']} (glibc's thread cache off), the "
              "C allocator of the runs it profiles", flush=True)
        sys.stderr.flush()
        os.execve(argv[0], argv, env)
    out, results, seconds = calibrate(args)
    one = results[1]
    print(f"wrote {out} in {seconds:.0f} s: best linear {max(r[3] for r in one.linear):.3g} TFLOP/s, operator "
          f"{one.kernel_overhead_us:.1f} + {one.backward_overhead_us:.1f} us (forward + backward), optimizer "
          f"{one.optimizer_gbps:.3g} GB/s")
    for n, r in sorted(results.items()):
        ar = r.collectives.get("all_reduce", {}).get(n)
        if ar:
            print(f"  {n} ranks: all-reduce of {size_text(int(ar[0][0]))} {1e6 * ar[0][1]:.0f} us, of "
                  f"{size_text(int(ar[-1][0]))} {1e3 * ar[-1][1]:.1f} ms; overlap {r.comm_overlap:.2f}")
    print(f"use it with: fivefold plan --hardware {out} ...", file=sys.stdout)
    return 0


def _load_note() -> str:
    """The 1-minute load average: above the core count, other work shared the machine with the timings."""
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"
