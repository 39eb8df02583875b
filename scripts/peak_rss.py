"""Run a command and sample, from outside, the resident memory (VmRSS) of it and every process it starts, every
0.1 s; print the largest resident memory of any one process over the whole run, and separately over the samples
taken while a checkpoint was being written (a `step_*.tmp` directory exists under RUN_DIR/checkpoints).

    python scripts/peak_rss.py --run-dir R -- fivefold train --run-dir R ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return found


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, help="the run directory whose checkpoints/ is watched")
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(command)
    peak = peak_save = peak_other = 0
    samples = save_samples = 0
    ckpts = Path(args.run_dir) / "checkpoints"
    while proc.poll() is None:
        saving = ckpts.is_dir() and any(ckpts.glob("step_*.tmp"))
        largest = max((rss_kib(p) for p in children(proc.pid)), default=0)
        peak = max(peak, largest)
        samples += 1
        if saving:
            peak_save, save_samples = max(peak_save, largest), save_samples + 1
        else:
            peak_other = max(peak_other, largest)
        time.sleep(args.interval)
    print(f"peak_rss: largest resident memory of any process {peak / 2**20:.2f} GiB over {samples} samples; "
          f"during checkpoint saves {peak_save / 2**20:.2f} GiB over {save_samples} samples, outside them "
          f"{peak_other / 2**20:.2f} GiB; exit code "
          f"{proc.returncode}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
