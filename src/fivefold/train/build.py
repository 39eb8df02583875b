"""Build the engine for a config: the one path from a config to a training step, for every layout.

1. The process grid (none on one device: a grid of one rank, with nothing to communicate).
2. The model parts this rank holds: the whole model is one part; under pipeline parallel this rank's stages
   (`pipeline.build_stages`). Under a grid they are described on the meta device and only this rank's shards are
   allocated later; on one device the model is built in place, initialised from the seed.
3. Steps 1 to 5 of `parallel.parallelize` on every part, in the documented order: tensor (and sequence) parallel,
   expert parallel, context parallel, activation recomputation, compile (`apply_model_parallel`).
4. Data parallel, once, over all of the parts (`apply_data_parallel`: one `parallel.data.DataParallel`, plus the
   experts' under ZeRO-0/1/2 with expert parallel).
5. The step runner, chosen once (`train.step`): the micro-batch loop, or the pipeline schedule over the stages.
"""

from __future__ import annotations

import functools

import torch

from fivefold.config import Config
from fivefold.device import autocast, use_bf16
from fivefold.models.llama import Llama, build_model
from fivefold.parallel.data import DataParallel, LocalDataParallel
from fivefold.parallel.float8 import check_float8
from fivefold.parallel.mesh import ProcessGrid
from fivefold.parallel.parallelize import LossModel, apply_data_parallel, apply_model_parallel
from fivefold.parallel.pipeline import (
    PipelineStage,
    WeightGradQueue,
    activation_dtype,
    build_stages,
    stage_layer_counts,
)
from fivefold.parallel.pipeline_zero3 import ShardedStage
from fivefold.parallel.schedules import build_schedule, stage_placement
from fivefold.train.engine import Engine
from fivefold.train.step import LlamaStage, MicroBatchLoop, PipelineSchedule, StepRunner

__all__ = ["Engine", "build_engine", "single_device_engine", "weight_grad_queue"]


def build_engine(cfg: Config, device: torch.device) -> Engine:
    """The engine for `cfg` on this rank (see the module docstring). Under a grid this validates the layout
    against the initialised world first; every rank allocates only its shards, initialised from the seed to the
    values one process would hold."""
    la = cfg.layout
    check_float8(cfg.train.float8, device)
    grid = ProcessGrid.build(cfg) if la.world_size > 1 or la.ep > 1 else None
    queue = weight_grad_queue(cfg)
    parts = model_parts(cfg, grid, device)
    for part in parts.values():
        apply_model_parallel(part, cfg, grid, queue)
    loss_model, data_parallels = apply_data_parallel(parts, cfg, grid, device)
    runner = MicroBatchLoop() if la.pp == 1 else pipeline_runner(parts, loss_model, data_parallels, queue, cfg,
                                                                 device)
    return Engine(cfg, device, parts, loss_model, data_parallels, runner, grid)


def weight_grad_queue(cfg: Config) -> WeightGradQueue | None:
    """Where the stages defer the linears' weight gradients (None: nowhere). The zero-bubble schedules' B / W split
    defers them all, and the overlap of the other schedules (`layout.pp_comm_overlap`), whose whole backward sends
    its input gradient before its weight gradients, the stage's first block's; not under ZeRO-3, whose stages
    reduce-scatter gradients that fully_shard's backward hooks collect, so that there the switch changes nothing."""
    la = cfg.layout
    if la.pp == 1:
        return None
    split = build_schedule(la.schedule, la.pp, cfg.grad_accum_steps, la.vpp).split_backward
    overlap = la.overlaps_pp_comm and la.zero < 3
    return WeightGradQueue(first_block_only=not split) if split or overlap else None


def model_parts(cfg: Config, grid: ProcessGrid | None, device: torch.device) -> dict[int, Llama]:
    """{global stage: module} of this rank: {0: the whole model} without pipeline parallel (built on `device` from
    the seed on one device, on the meta device under a grid), else this rank's stages on the meta device."""
    if grid is None:
        return {0: build_model(cfg.model, device=device, seed=cfg.train.seed)}
    if cfg.layout.pp == 1:  # on the meta device: no rank holds the full model
        return {0: build_model(cfg.model, device="meta")}
    la = cfg.layout
    placement = stage_placement(la.schedule, la.pp, la.vpp)
    return build_stages(cfg.model, stage_layer_counts(cfg), placement, grid.ranks["pp"], torch.device("meta"),
                        cfg.train.seed)


def pipeline_runner(stages: dict[int, Llama], loss_model: LossModel | None, data_parallels: list[DataParallel],
                    queue: WeightGradQueue | None, cfg: Config, device: torch.device) -> StepRunner:
    """The pipeline schedule over this rank's stages; under ZeRO-3 each stage tells its `fully_shard` units which
    backward of the step reduce-scatters (`pipeline_zero3.ShardedStage`)."""
    la = cfg.layout
    placement = stage_placement(la.schedule, la.pp, la.vpp)
    n = len(placement)
    bf16 = use_bf16(cfg, device)
    run_autocast = functools.partial(autocast, device, bf16)
    runners: dict[int, PipelineStage] = {
        s: LlamaStage(m, loss_model if s == n - 1 else None, s, n, queue, cfg, run_autocast)
        for s, m in stages.items()}
    if la.zero == 3:
        wire = activation_dtype(list(stages.values()), bf16)
        runners = {s: ShardedStage(r, s, data_parallels[0], queue, wire) for s, r in runners.items()}
    return PipelineSchedule(stages, runners, stage_layer_counts(cfg), placement, queue, cfg)


def single_device_engine(model: Llama, cfg: Config, device: torch.device, lean: bool = False) -> Engine:
    """An engine on one device around a model already built (no recompute, no compile): with `lean`, lean mixed
    precision (bf16 working weights, fp32 masters); without it, the weights stay fp32 and bf16 (when `cfg` asks
    for it) is autocast per matmul, the reference that lean mixed precision is checked against."""
    data_parallel = LocalDataParallel(model, lean, cfg.layout.fp32_grad_accum)
    loss_model = LossModel(model, None, cfg.layout.sp, cfg.train.compile)
    return Engine(cfg, device, {0: model}, loss_model, [data_parallel], MicroBatchLoop())
