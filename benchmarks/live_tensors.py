"""The live tensor bytes of each run of a CPU sweep grid, measured, beside the planner's count of them.

A sweep compares the planner's peak with each run's resident set, which also holds what glibc keeps of freed memory
(a profile's `heap_retention`). This separates the two: every run of the grid is repeated through `fivefold bench`
with `torch.profiler` recording memory (`profile_memory=True`) in every rank, each rank's live CPU tensor bytes are
rebuilt from the profiler's allocation and free events (matched by address), and their peak is printed beside the
planner's live bytes for the layout (its peak without `allocator_cache`, on the built-in `cpu` profile). (The resident
set of these runs is not shown: the profiler's own event buffers grow it, 2-4x the live bytes at micro-batch 4; the
sweep's runs measure it without a profiler.)

The profiler's own running total ("Total Allocated") is not used: it subtracts only the frees it records, and a
tensor freed on a gloo thread, where the profiler is off, stays counted (tp2 of `examples/sweep-cpu.toml`: 69.7 MiB
by the total, 38.7 MiB rebuilt, 40.6 MiB planned). ZeRO-3 (`fully_shard`) runs allocate where the profiler does not
see them: shown as "-". On the 2-core machine, 2026-11-29: docs/sweeps.md ("Live tensors against the planner").

    PYTHONPATH=src python benchmarks/live_tensors.py examples/sweep-cpu.toml
    PYTHONPATH=src python benchmarks/live_tensors.py examples/sweep-cpu.toml --only pp2 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fivefold.config import dump_toml
from fivefold.planner.hardware import get_cluster
from fivefold.planner.predict import estimate_run
from fivefold.sweep.grid import expand, load_grid
from fivefold.sweep.runner import subprocess_env

MIB = 2**20

# imported by every Python process of the run (the launcher and its ranks): records memory events for the whole
# process and, at exit, writes the rebuilt peak of its live tensor bytes as JSON beside the rank number
SITE = '''
import atexit, json, os
import torch

_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
_prof.__enter__()


def _report():
    _prof.__exit__(None, None, None)
    trace = f"{os.environ['FIVEFOLD_LIVE_OUT']}.{os.getpid()}.trace.json"
    _prof.export_chrome_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    os.remove(trace)
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live, now, peak = {}, 0, 0
    for e in memory:
        size, address = e["args"]["Bytes"], e["args"]["Addr"]
        if size > 0:
            now += size - live.get(address, 0)
            live[address] = size
        else:
            now -= live.pop(address, 0)
        peak = max(peak, now)
    with open(f"{os.environ['FIVEFOLD_LIVE_OUT']}.{os.getpid()}.json", "w") as f:
        json.dump({"rank": os.environ.get("RANK"), "events": len(memory), "peak_bytes": peak}, f)


atexit.register(_report)
'''


def measure(plan, steps: int, warmup: int, work: Path) -> list[float]:
    """The live peak (MiB) of each rank of one run, in rank order."""
    folder = work / plan.key
    site = folder / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITE)
    (folder / "config.toml").write_text(dump_toml(plan.cfg))
    out = folder / "result.json"
    env = subprocess_env(cpu=True)
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    env["FIVEFOLD_LIVE_OUT"] = str(folder / "live")
    cmd = [sys.executable, "-m", "fivefold", "bench", "--nproc", str(plan.n_devices), "--config",
           str(folder / "config.toml"), "--micro-batch", str(plan.micro_batch_size), "--grad-accum",
           str(plan.grad_accum_steps), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"{plan.label}: fivefold bench failed (exit {done.returncode}): {tail[0]}")
    ranks = [json.loads(p.read_text()) for p in folder.glob("live.*.json")]
    ranks = sorted((r for r in ranks if r["rank"] is not None or plan.n_devices == 1),
                   key=lambda r: int(r["rank"] or 0))
    return [r["peak_bytes"] / MIB if r["events"] else 0.0 for r in ranks]


def planned_live(cfg) -> dict[str, float]:
    """The planner's live bytes (MiB) of the first and last pipeline ranks, without the allocator's cache."""
    e = estimate_run(cfg, get_cluster("cpu"), "cpu")
    return {rank: sum(v for k, v in parts.items() if k != "allocator_cache") / MIB for rank, parts in e.memory.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a sweep grid file (examples/sweep-cpu.toml)")
    ap.add_argument("--only", default="", help="only the runs whose label contains this text")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    plans, _ = expand(load_grid(args.grid))
    plans = [p for p in plans if p.invalid is None and args.only in p.label]
    if not plans:
        raise SystemExit(f"no runnable run of {args.grid} has {args.only!r} in its label")
    print(f"{len(plans)} runs, {args.steps} steps after {args.warmup}; MiB: live tensors rebuilt from the profiler "
          "(largest rank), the planner's live bytes (its largest rank), their difference (planned / measured - 1)",
          flush=True)
    print(f"{'run':48s} {'measured':>9s} {'planned':>8s} {'diff':>6s}  per rank")
    with tempfile.TemporaryDirectory(prefix="fivefold-live-") as d:
        for plan in plans:
            live = measure(plan, args.steps, args.warmup, Path(d))
            planned = planned_live(plan.cfg)
            top, want = max(live, default=0.0), max(planned.values())
            if top <= 1.0:  # nothing seen (fully_shard's allocations)
                print(f"{plan.label:48s} {'-':>9s} {want:8.1f} {'-':>6s}", flush=True)
                continue
            ranks = " ".join(f"{x:.1f}" for x in live)
            pipeline = (f" (planned first {planned['first']:.1f}, last {planned['last']:.1f})" if "last" in planned
                        else "")
            print(f"{plan.label:48s} {top:9.1f} {want:8.1f} {100 * (want / top - 1):+5.0f}%  {ranks}{pipeline}",
                  flush=True)


if __name__ == "__main__":
    main()
