"""What glibc's thread cache costs a CPU run in resident memory, and whether it grows with the steps: `fivefold bench`
of the tiny model (16 sequences of 128 tokens, fp32) on each layout, at two step counts, with the cache on (glibc's
default count, 7, set in GLIBC_TUNABLES) and off (what fivefold's launcher sets for CPU ranks,
`device.cpu_allocator_env`). Prints the peak resident set above each process's baseline (the largest rank's) and the
median step time. On the 2-core machine, 2026-11-29: see docs/sweeps.md.

    python benchmarks/cpu_heap.py                       # tp2 + sp, tp2, dp2, one process; 6 and 30 timed steps
    python benchmarks/cpu_heap.py --layouts tp2sp --steps 6 30 60
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fivefold.device import TCACHE_TUNABLE, cpu_allocator_env

LAYOUTS = {
    "tp2sp": (2, "tp = 2\nsp = true\nmicro_batch_size = 8\n"),
    "tp2": (2, "tp = 2\nmicro_batch_size = 8\n"),
    "dp2": (2, "dp = 2\nmicro_batch_size = 8\n"),
    "one": (1, "micro_batch_size = 16\n"),
}
BASE = ('[model]\npreset = "tiny"\n[train]\nseq_len = 128\nglobal_batch_size = 16\ndevice = "cpu"\n'
        'dtype = "fp32"\n[layout]\n')


def bench(layout: str, steps: int, cache_on: bool, folder: Path) -> tuple[float, float]:
    """(peak MiB above the baseline, median step ms) of one `fivefold bench` run."""
    nproc, table = LAYOUTS[layout]
    config, out = folder / f"{layout}.toml", folder / f"{layout}-{steps}-{cache_on}.json"
    config.write_text(BASE + table)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    # the cache on: glibc's default count, which the launcher keeps as a count the user set; off: as the launcher sets
    # it (here also for one process, which is started here, not by the launcher)
    env = {**env, "GLIBC_TUNABLES": f"{TCACHE_TUNABLE}=7"} if cache_on else cpu_allocator_env(env)
    cmd = [sys.executable, "-m", "fivefold", "bench", "--config", str(config), "--nproc", str(nproc),
           "--steps", str(steps), "--warmup", "2", "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    r = json.loads(out.read_text())
    return max(r["peak_memory_bytes_per_rank"]) / 2**20, 1e3 * r["step_time_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["tp2sp", "tp2", "dp2", "one"])
    p.add_argument("--steps", nargs="+", type=int, default=[6, 30])
    args = p.parse_args()
    print(f"{'layout':8s} {'steps':>5s} {'cache on: MiB, ms':>20s} {'cache off: MiB, ms':>20s}")
    with tempfile.TemporaryDirectory() as d:
        for layout in args.layouts:
            for steps in args.steps:
                on, off = (bench(layout, steps, cache, Path(d)) for cache in (True, False))
                print(f"{layout:8s} {steps:5d} {on[0]:12,.0f} {on[1]:7,.0f} {off[0]:12,.0f} {off[1]:7,.0f}", flush=True)


if __name__ == "__main__":
    main()
