"""One group of ranks of `fivefold calibrate`: `measure_group` runs a plan on N local processes, started by the
project's launcher (`fivefold.launch.launch`, as `fivefold train --nproc` is) as `fivefold calibrate --worker
FILE`; each joins the group (`init_distributed`), creates the run's process groups once, measures, and rank 0
writes the figures back. One rank runs in this process, without a process group."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.device import local_device
from fivefold.launch import environment, import_path, init_distributed, launch  # the project's launcher
from fivefold.tools.calibrate.harness import Clock, RankGroups, two_passes
from fivefold.tools.calibrate.measure_comm import (
    measure_collective_wait,
    measure_collectives,
    measure_overlap,
    measure_posted_p2p_wait,
    measure_zero3_unit,
    monotone,
)
from fivefold.tools.calibrate.measure_compute import (
    measure_attention,
    measure_elementwise,
    measure_fixed_cost,
    measure_linear,
    measure_loss,
    measure_optimizer,
)
from fivefold.tools.calibrate.targets import Plan, Result


def run_ranks(plan: Plan, device: torch.device, groups: RankGroups) -> Result:
    """Everything this rank measures of `plan` with the ranks of `groups` (the same figures on every rank)."""
    start = time.perf_counter()
    world, rank = groups.world, groups.rank
    prefix = f"[{world} rank{'s' if world > 1 else ''}]"

    def say(text: str) -> None:
        if rank == 0 and not plan.quiet:
            print(f"calibrate {prefix} {text}", flush=True)

    dtype = torch.float32 if plan.device_type == "cpu" else torch.bfloat16
    clock = Clock(device, world, plan.min_seconds, plan.sample_seconds, groups.cpu)
    result = Result(world)
    if plan.compute:
        result.linear = two_passes(lambda s: measure_linear(clock, s, dtype, say), plan.linear, 3, plan.passes)
        result.attention = two_passes(lambda s: measure_attention(clock, s, dtype, say), plan.attention, 3,
                                      plan.passes)
        result.loss = two_passes(lambda s: measure_loss(clock, s, dtype, say), plan.loss, 3, plan.passes)
        long_clock = Clock(device, world, 6 * plan.min_seconds, plan.sample_seconds, groups.cpu)
        fixed = [measure_fixed_cost(long_clock, dtype, say) for _ in range(plan.passes)]
        result.kernel_overhead_us = 1e6 * min(f for f, _ in fixed)
        result.backward_overhead_us = 1e6 * min(b for _, b in fixed)
        result.elementwise = two_passes(lambda n: measure_elementwise(clock, n, dtype, say), plan.elementwise_numel,
                                        1, plan.passes)
        optimizer = [measure_optimizer(long_clock, plan.optimizer_numel, say) for _ in range(plan.passes)]
        result.optimizer_gbps = max(g for g, _ in optimizer)
        result.optimizer_tensor_us = 1e6 * min(t for _, t in optimizer)
    if world > 1:
        passes = [measure_collectives(clock, groups, plan, say, reverse=i % 2 == 1) for i in range(plan.passes)]
        result.collectives = {kind: {size: monotone([[b, min(p[kind][size][j][1] for p in passes)]
                                                     for j, (b, _) in enumerate(rows)])
                                     for size, rows in sizes.items()}
                              for kind, sizes in passes[0].items()}
        result.comm_overlap = measure_overlap(clock, dtype, say)
        # waits are the ranks' own contention for the cores, not noise on top of a figure: the mean of several
        # passes (a single pass reads anywhere between none and a scheduler time slice)
        passes = 2 * plan.passes
        waits = [measure_collective_wait(clock, groups, dtype, say) for _ in range(passes)]
        result.collective_wait = [[row[0], statistics.fmean(w[i][1] for w in waits)] for i, row in enumerate(waits[0])]
        result.posted_p2p_wait_us = 1e6 * statistics.fmean(measure_posted_p2p_wait(clock, groups, dtype, say)
                                                           for _ in range(passes))
        if plan.model is not None:
            result.zero3_unit_us = 1e6 * measure_zero3_unit(clock, plan.model, result.collectives, say)
    result.seconds = time.perf_counter() - start
    return result


def worker(path: str) -> int:
    """`fivefold calibrate --worker FILE` in each started process: FILE holds the plan and where rank 0 writes
    the figures."""
    start = time.perf_counter()
    job = json.loads(Path(path).read_text())
    plan = Plan.from_json(job["plan"])
    device = local_device(plan.device_type)
    if plan.device_type == "cpu":
        torch.set_num_threads(plan.threads)
    init_distributed(plan.device_type)
    try:
        result = run_ranks(plan, device, RankGroups.create(plan.device_type))
        result.seconds = time.perf_counter() - start  # joining the group included, as one rank's figures
        if dist.get_rank() == 0:
            Path(job["out"]).write_text(json.dumps(result.to_json()))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def measure_group(plan: Plan, world: int) -> Result:
    """Run `plan` on `world` local processes (in this process when 1) and return rank 0's figures."""
    if world == 1:
        threads = torch.get_num_threads()
        if plan.device_type == "cpu":
            torch.set_num_threads(plan.threads)
        else:
            torch.accelerator.set_device_index(0)
        try:
            return run_ranks(plan, torch.device(plan.device_type) if plan.device_type == "cpu" else
                             torch.device(plan.device_type, 0), RankGroups.single())
        finally:
            torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp, "plan.json"), Path(tmp, "result.json")
        job.write_text(json.dumps({"plan": plan.to_json(), "out": str(out)}))
        with _children_environment(plan):  # on the CPU the launcher turns glibc's thread cache off, as for the runs
            status = launch(world, ["--worker", str(job)], verb="calibrate", cpu=plan.device_type == "cpu")
        if status != 0 or not out.exists():
            raise RuntimeError(f"calibrate: the {world} processes measuring together failed (exit status "
                               f"{status}); see their messages above")
        return Result.from_json(json.loads(out.read_text()))


def _children_environment(plan: Plan) -> contextlib.AbstractContextManager:
    """The environment the started processes inherit, for the launch only: they import this same fivefold
    (its directory first on PYTHONPATH: the package may be on this process's path only, as under pytest), and
    on CPU run the plan's threads per rank (OMP_NUM_THREADS, which the launcher would otherwise set to 1)."""
    values = {"PYTHONPATH": import_path(os.environ.get("PYTHONPATH"))}
    if plan.device_type == "cpu":
        values["OMP_NUM_THREADS"] = str(plan.threads)
    return environment(values)
