"""Measure the step time of the CPU grid's layouts and compare it with the planner's prediction.

Each layout runs as its own process group (`torch.distributed.run`, gloo, one process per rank, the way
`fivefold train --nproc N` starts them: one intra-op thread per process when N > 1, PyTorch's default when
N = 1) for a few warm-up and timed steps of the training engine on synthetic tokens; rank 0 prints the
mean step time. The prediction is `planner.search.estimate` with a hardware profile from `fivefold
calibrate` (`--hardware`). Prints per run measured vs predicted, the median absolute error and Spearman.

    python benchmarks/cpu_grid.py --hardware cpu.toml                     # measure and compare
    python benchmarks/cpu_grid.py --hardware cpu.toml --measured runs.jsonl   # compare stored measurements
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# examples/sweep-cpu.toml's runnable layouts (tiny, seq 128, 16 sequences per step, one thread per process):
# (dp, tp, sp, zero, micro-batch, recompute)
SWEEP_CPU = [
    *[(1, 1, False, 0, m, r) for m in (4, 16) for r in ("none", "selective", "full")],
    *[(2, 1, False, z, 8, "none") for z in (0, 1, 2, 3)],
    *[(1, 2, sp, 0, 8, "none") for sp in (False, True)],
    (4, 1, False, 1, 4, "none"), (2, 2, False, 1, 4, "none"),
]
# more of the same space: micro-batches, ZeRO stages and recompute under each world size
EXTENDED = [
    *[(1, 1, False, 0, m, "none") for m in (1, 2, 8)],
    *[(2, 1, False, z, m, "none") for z in (0, 2, 3) for m in (1, 4)],
    (2, 1, False, 0, 8, "full"), (2, 1, False, 1, 2, "none"),
    *[(1, 2, False, 0, m, "none") for m in (1, 2, 4, 16)], (1, 2, True, 0, 2, "none"), (1, 2, False, 0, 8, "full"),
    *[(4, 1, False, z, m, "none") for z in (0, 2, 3) for m in (1, 4)], (4, 1, False, 1, 2, "none"),
    *[(2, 2, sp, z, m, "none") for sp in (False, True) for z in (0, 2) for m in (1, 8)],
]
GRIDS = {"sweep-cpu": SWEEP_CPU, "extended": EXTENDED, "all": SWEEP_CPU + EXTENDED}
MODEL, SEQ, GLOBAL_BATCH = "tiny", 128, 16


def worker(spec: dict) -> None:
    """One rank: build the engine for the layout and time `steps` steps after `warmup`."""
    import torch
    import torch.distributed as dist

    from fivefold.config import build_config
    from fivefold.parallel import init_distributed
    from fivefold.train.engine import create_engine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)  # as the sweep's CPU grid (train.threads = 1) and torchrun for several processes
    if world > 1:
        init_distributed("cpu")
    cfg = build_config(None, {"model.preset": spec["model"]})
    cfg.train.seq_len = spec["seq_len"]
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, spec["seq_len"])
    cfg.train.global_batch_size = spec["global_batch"]
    cfg.layout.dp, cfg.layout.tp, cfg.layout.zero = spec["dp"], spec["tp"], spec["zero"]
    cfg.layout.sp = spec["sp"]
    cfg.layout.micro_batch_size, cfg.layout.recompute = spec["mbs"], spec["recompute"]
    cfg.train.device = "cpu"
    cfg.validate()
    engine = create_engine(cfg, torch.device("cpu"))
    rows = spec["global_batch"] // spec["dp"]
    gen = torch.Generator().manual_seed(1 + engine.dp_rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, spec["seq_len"] + 1), generator=gen)
    micro = list(zip(tokens[:, :-1].split(spec["mbs"]), tokens[:, 1:].split(spec["mbs"]), strict=True))
    global_tokens = spec["global_batch"] * spec["seq_len"]

    def step() -> None:
        engine.forward_backward(micro, global_tokens)
        engine.optimizer_step()

    for _ in range(spec["warmup"]):
        step()
    times = []
    for _ in range(spec["steps"]):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("RESULT " + json.dumps({**spec, "step_times": times}), flush=True)
    if world > 1:
        dist.destroy_process_group()


def running_processes() -> int:
    """Processes running or runnable now, machine-wide (/proc/loadavg's fourth field)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def wait_quiet(max_wait: float, threshold: float = 1.5) -> float:
    """Wait (at most `max_wait` s) until, over 3 s, on average at most `threshold` processes run (this one
    included); returns that average, the other work present when the run starts."""
    deadline = time.monotonic() + max_wait
    while True:
        samples = []
        for _ in range(15):
            samples.append(running_processes())
            time.sleep(0.2)
        mean = statistics.fmean(samples)
        if mean <= threshold or time.monotonic() > deadline:
            return mean
        time.sleep(5)


def measure(spec: dict, timeout: float) -> dict:
    world = spec["dp"] * spec["tp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(world), __file__, "--worker", json.dumps(spec)]
    samples: list[int] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        start = time.monotonic()
        while proc.poll() is None and time.monotonic() - start < timeout:
            samples.append(running_processes())
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        stdout, stderr = proc.communicate()
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            # other work: processes running beyond this run's ranks (and this script)
            other = max(0.0, statistics.fmean(samples) - world - 1) if samples else 0.0
            return {**json.loads(line[7:]), "other_running": other}
    raise RuntimeError(f"layout {spec} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")


def predict(spec: dict, hw) -> float:
    from fivefold.models.presets import get_preset
    from fivefold.planner.layout import FIVEFOLD_CPU, Layout
    from fivefold.planner.search import estimate

    cfg = get_preset(spec["model"])
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, spec["seq_len"]))
    lay = Layout(dp=spec["dp"], tp=spec["tp"], sp=spec["sp"], zero=spec["zero"], mbs=spec["mbs"],
                 grad_acc=spec["global_batch"] // (spec["dp"] * spec["mbs"]), recompute=spec["recompute"])
    return estimate(cfg, spec["seq_len"], lay, FIVEFOLD_CPU, hw).step_time_s


def name_of(run: dict) -> str:
    return (f"dp{run['dp']} tp{run['tp']}{'+sp' if run['sp'] else ''} z{run['zero']} mbs{run['mbs']} "
            f"rc:{run['recompute']}")


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--hardware", help="hardware profile TOML (from `fivefold calibrate`)")
    p.add_argument("--measured", nargs="+", help="JSON lines of stored measurements: compare them instead")
    p.add_argument("--out", help="append each measurement to this JSON lines file")
    p.add_argument("--grid", choices=sorted(GRIDS), default="sweep-cpu")
    p.add_argument("--steps", type=int, default=5, help="timed steps (the sweep's grid: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the sweep's grid: 2)")
    p.add_argument("--only", type=int, nargs="*", help="indices of the layouts to run")
    p.add_argument("--rounds", type=int, default=1, help="measure the grid this many times (interleaved)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each run wait up to S seconds for the machine to be idle")
    args = p.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    layouts = GRIDS[args.grid]
    runs: list[dict] = []
    if args.measured:
        for path in args.measured:
            runs += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    else:
        for rnd in range(args.rounds):
            for i, (dp, tp, sp, zero, mbs, rc) in enumerate(layouts):
                if args.only and i not in args.only:
                    continue
                spec = {"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "dp": dp, "tp": tp, "sp": sp,
                        "zero": zero, "mbs": mbs, "recompute": rc, "steps": args.steps, "warmup": args.warmup}
                before = wait_quiet(args.wait_quiet) if args.wait_quiet else None
                t0 = time.perf_counter()
                run = measure(spec, 600)
                run.update(load=os.getloadavg()[0], running_before=before, round=rnd)
                runs.append(run)
                print(f"[round {rnd + 1}, {i + 1}/{len(layouts)}] {name_of(run)}: "
                      f"{1e3 * statistics.median(run['step_times']):.0f} ms "
                      f"({', '.join(f'{1e3 * t:.0f}' for t in run['step_times'])}) in {time.perf_counter() - t0:.0f} s"
                      f", other processes running {run['other_running']:.1f}", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(run) + "\n")
    if not args.hardware:
        return
    from fivefold.planner.hardware import get_cluster

    hw = get_cluster(None, args.hardware)
    # each layout: its rounds' median step times; the fastest round is the one least slowed by other work
    by_layout: dict[str, list[dict]] = {}
    for run in runs:
        by_layout.setdefault(name_of(run), []).append(run)
    measured, predicted = [], []
    print(f"{'layout':34s} {'measured ms':>12s} {'spread':>7s} {'predicted ms':>13s} {'error':>7s}")
    spreads = []
    for name, group in by_layout.items():
        medians = [statistics.median(r["step_times"]) for r in group]
        m, pr = min(medians), predict(group[0], hw)
        spread = max(medians) / m - 1 if len(medians) > 1 else (max(group[0]["step_times"]) /
                                                                  min(group[0]["step_times"]) - 1)
        spreads.append(spread)
        measured.append(m)
        predicted.append(pr)
        print(f"{name:34s} {1e3 * m:12.1f} {100 * spread:6.0f}% {1e3 * pr:13.1f} {100 * (pr - m) / m:+6.1f}%")
    errors = [abs(pr - m) / m for m, pr in zip(measured, predicted, strict=True)]
    print(f"runs {len(measured)} ({len(runs)} measurements): median |error| {100 * statistics.median(errors):.1f} %, "
          f"Spearman {spearman(measured, predicted):.3f}; median spread between measurements "
          f"{100 * statistics.median(spreads):.0f} %")


if __name__ == "__main__":
    main()
