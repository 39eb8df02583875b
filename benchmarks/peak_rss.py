"""Largest resident memory of any process of a command, sampled from outside.

Runs the command, and every `--interval` seconds reads VmRSS from /proc/PID/status of the command and of every
descendant (the launcher's ranks included). Prints the largest VmRSS any one process reached over the whole run, and
the same per phase of `fivefold train`, read from its output: "construction" until the first `step` line, "steps"
until the last step's validation line, then "save" (that validation and the final checkpoint). With `--run-dir`,
the samples taken while a checkpoint is being written (a `step_*.tmp` directory under RUN_DIR/checkpoints) are
also counted apart, as "writing a checkpoint".
Linux only (reads /proc).

    python benchmarks/peak_rss.py -- PYTHONPATH=src python -m fivefold train ...
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen


def rss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def measure(command: str, run_dir: str | None = None, interval: float = 0.1, echo: bool = True) -> tuple[
    int, dict[str, int], int
]:
    """Run the shell command `command` (its output echoed); (largest VmRSS of any one process over the run in KiB,
    the same per phase, the command's exit status)."""
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    phase = ["construction"]
    peaks: dict[str, int] = {}
    overall = 0

    def reader() -> None:
        for line in proc.stdout:
            if echo:
                sys.stdout.write(line)
            if phase[0] == "construction" and re.match(r"step\s+\d+/", line):
                phase[0] = "steps"
            final = re.match(r"step\s+(\d+)/(\d+)\s+val_loss", line)
            if final and final.group(1) == final.group(2):  # the last validation, then the final checkpoint
                phase[0] = "save"

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    while proc.poll() is None:
        largest = max((rss_kib(p) for p in descendants(proc.pid)), default=0)
        overall = max(overall, largest)
        peaks[phase[0]] = max(peaks.get(phase[0], 0), largest)
        checkpoints = Path(run_dir or "", "checkpoints")
        if run_dir and checkpoints.is_dir() and any(checkpoints.glob("step_*.tmp")):
            peaks["writing a checkpoint"] = max(peaks.get("writing a checkpoint", 0), largest)
        time.sleep(interval)
    thread.join()
    return overall, peaks, proc.returncode


def describe(overall: int, peaks: dict[str, int]) -> str:
    return (f"peak VmRSS of any process: {overall / 1024:.1f} MiB "
            + " ".join(f"({name}: {kib / 1024:.1f} MiB)" for name, kib in peaks.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--run-dir", help="the run directory whose checkpoints/ is watched for a save in progress")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    overall, peaks, status = measure(" ".join(command), args.run_dir, args.interval)
    print(describe(overall, peaks), flush=True)
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
