"""The planner's search time on the largest layout space it is asked about: Llama 3 405B on 16,384 H100
(`fivefold plan --model llama3-405b --nodes 2048 --seq-len 8192 --global-batch 16M`), through the Python API.
Prints the layouts tried, the processes that judged them (`planner.search.search_workers`: one per core for a
search this size; FIVEFOLD_PLAN_WORKERS=1 runs it in this process), the CPU seconds of this process (the whole
search's with FIVEFOLD_PLAN_WORKERS=1: the figure to compare between machines, as a loaded machine stretches the
wall time) and the wall seconds (what a user waits).

    PYTHONPATH=src python benchmarks/plan_search_time.py
    FIVEFOLD_PLAN_WORKERS=1 PYTHONPATH=src python benchmarks/plan_search_time.py
"""

from __future__ import annotations

import os
import time

from fivefold.planner.hardware import get_cluster
from fivefold.planner.layout import FIVEFOLD
from fivefold.planner.search import search
from fivefold.presets import get_preset


def main() -> None:
    cfg, hw = get_preset("llama3-405b"), get_cluster("h100")
    workers: list[int] = []
    wall, cpu = time.perf_counter(), time.process_time()
    result = search(cfg, 8192, 2048, 16384, FIVEFOLD, hw, top=5, progress=lambda n, w: workers.append(w))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"llama3-405b on 16,384 H100, seq 8192, global batch 2048 sequences: {result.evaluated:,} layouts tried, "
          f"{len(result.candidates)} returned, on {workers[0]} process(es); {cpu:.1f} s of CPU in this process, "
          f"{wall:.1f} s of wall time (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
