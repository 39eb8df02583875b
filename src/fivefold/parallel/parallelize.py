"""Apply the parallel techniques to a plain `Llama`, from outside and in one fixed order:

0. pipeline parallel (`layout.pp > 1`, before this module, by `pipeline.build_stages`): each rank keeps only its
   stages' blocks, and steps 1 to 5 apply to each stage (`parallelize_stages`);
1. tensor parallel (with sequence parallel when `layout.sp`): shards the projections, the MLP/experts and
   the vocabulary over the tp ranks, in place, keeping every parameter name; under a zero-bubble pipeline
   schedule the linears then defer their weight gradients to the W pass (`pipeline.defer_weight_grads`);
2. expert parallel (`layout.ep`): keeps this rank's experts of each MoE layer (whole experts, already split
   along their ffn dim by tp) and routes tokens to them with all-to-alls over the ep group;
3. context parallel (`layout.cp`): attention becomes ring attention over the cp group, MoE statistics that
   span the sequence are summed over it; the engine feeds each rank its zig-zag chunks of every sequence;
4. activation recomputation (`layout.recompute`: none, selective = the attention core, full = each block);
5. `torch.compile` of each block (`train.compile`);
6. data parallel last, because it works on whatever parameters the steps before left (tp and ep shards):
   ZeRO-0/1/2 as flat gradient buckets with hooks, ZeRO-3 as `fully_shard` units per block. Dense gradients
   are reduced over dp x cp, expert gradients (under ep) over the ranks that hold the same experts.

The model file holds no parallel code; this order is the one torchtitan documents (TP, then CP, then
activation checkpointing, then compile, then data-parallel sharding), for the same reasons: data parallel
must see the local parameters, and recompute must wrap the modules that communicate (so that a recomputed
block repeats its tp, ep and cp communication in backward, the same on every rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fivefold.config import Config
from fivefold.device import use_bf16
from fivefold.models.llama import Llama, full_parameter_shapes, materialize
from fivefold.models.loss import model_loss_sum
from fivefold.parallel.data import (
    DEFAULT_BUCKET_BYTES,
    BucketedDataParallel,
    FullyShardedDataParallel,
    dim0_shard,
)
from fivefold.parallel.mesh import ProcessGrid

if TYPE_CHECKING:
    from fivefold.parallel.pipeline import WeightGradQueue


class LossModel(nn.Module):
    """The model and its loss as one module: `forward(inputs, targets, positions)` is the summed token loss of
    the rows (positions: the rotary positions of a context-parallel rank's tokens, None for 0..seq-1).

    Under tensor parallel the output layer and the cross-entropy are vocabulary-parallel (the full logits never
    exist); otherwise the fused chunked output layer + loss of the single-device engine. ZeRO-3's root unit
    wraps this module, so that its hooks run around the whole micro-batch."""

    def __init__(self, model: Llama, grid: ProcessGrid, sequence_parallel: bool, compiled: bool = False) -> None:
        super().__init__()
        self.model, self.compiled = model, compiled
        self.grid, self.sequence_parallel = grid, sequence_parallel
        self.compute_dtype = torch.float32

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> (
        torch.Tensor
    ):
        dtype = torch.bfloat16 if torch.is_autocast_enabled(inputs.device.type) else torch.float32
        if self.grid.size("tp") == 1:  # the single-device engine's loss
            return model_loss_sum(self.model, inputs, targets, positions, dtype, self.compiled)
        from fivefold.parallel.tensor import vocab_parallel_loss_sum

        hidden = self.model.forward_hidden(inputs, positions)
        return vocab_parallel_loss_sum(self.model, hidden, targets, self.grid.tp_group, self.sequence_parallel,
                                       compute_dtype=dtype)


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def tp_sharded_names(model: nn.Module, tp: int) -> set[str]:
    """Names of the parameters split over tp (the others are replicated on every tp rank)."""
    if tp == 1:
        return set()
    from fivefold.parallel.tensor import tp_shard_dim

    return {name for name, _ in model.named_parameters() if tp_shard_dim(name) is not None}


DataParallel = BucketedDataParallel | FullyShardedDataParallel


def apply_model_parallel(model: Llama, cfg: Config, grid: ProcessGrid,
                         weight_grad_queue: WeightGradQueue | None = None) -> None:
    """Steps 1 to 5 on one model (or pipeline stage), in place."""
    la = cfg.layout
    if grid.size("tp") > 1:  # 1. tensor (and sequence) parallel
        from fivefold.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, grid.tp_group, la.sp)
    if weight_grad_queue is not None:  # the zero-bubble schedules' B / W split
        from fivefold.parallel.pipeline import defer_weight_grads

        defer_weight_grads(model, weight_grad_queue)
    if la.ep > 1:  # 2. expert parallel
        from fivefold.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, grid.groups["ep"])
    if grid.size("cp") > 1:  # 3. context parallel
        from fivefold.parallel.context import apply_context_parallel

        apply_context_parallel(model, grid.groups["cp"])
    if la.recompute != "none":  # 4. activation recomputation
        from fivefold.parallel.recompute import apply_recompute

        apply_recompute(model, la.recompute)
    if cfg.train.compile:  # 5. compile each block
        for block in model.layers.values():
            block.compile()


def shard_regions(model: Llama, grid: ProcessGrid) -> dict[str, tuple[tuple[int, int], ...]]:
    """The part of the full plain tensor that each of `model`'s parameters holds on this rank, (start, stop) per
    dim: the tp slice along its `tp_shard_dim`, the ep rank's experts along dim 0, and under ZeRO-3 (a
    `fully_shard` DTensor) this rank's chunk of dim 0 of that."""
    from fivefold.parallel.expert import is_expert_param
    from fivefold.parallel.tensor import tp_shard_dim

    shapes = full_parameter_shapes(model.cfg)
    tp, tp_rank = grid.size("tp"), grid.ranks["tp"]
    ep = grid.size("ep")
    ep_rank = grid.group_ranks["ep"].index(grid.rank) if ep > 1 else 0
    regions = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        region = [(0, n) for n in shapes[name]]
        dim = tp_shard_dim(name) if tp > 1 else None
        if dim is not None:
            size = shapes[name][dim] // tp
            region[dim] = (tp_rank * size, (tp_rank + 1) * size)
        if ep > 1 and is_expert_param(name):
            size = shapes[name][0] // ep
            region[0] = (ep_rank * size, (ep_rank + 1) * size)
        if hasattr(param, "device_mesh"):  # fully_shard: torch.chunk's split of dim 0 over the mesh
            start, stop = region[0]
            rows = stop - start
            index, chunks = dim0_shard(param)
            chunk = -(-rows // chunks)
            lo = min(rows, index * chunk)
            region[0] = (start + lo, start + min(rows, lo + chunk))
        regions[name] = tuple(region)
    return regions


def materialize_shards(model: Llama, grid: ProcessGrid, device: torch.device, seed: int,
                       root: nn.Module | None = None) -> None:
    """Allocate this rank's shards of a model built and sharded on the meta device, initialised to the same
    values as the one-process model's slices (`models.llama.initial_values`): no rank allocates a full tensor.
    `root`: the outermost module to allocate from (ZeRO-3's root unit, which holds the model)."""
    materialize(model, device, seed, shard_regions(model, grid), root)


def parallelize(model: Llama, cfg: Config, grid: ProcessGrid, device: torch.device,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[LossModel, DataParallel,
                                                                   BucketedDataParallel | None]:
    """Apply the layout to `model` in place (see the module docstring); return the loss module to call, the
    data-parallel state that reduces the dense gradients and, under expert parallel, the one that reduces the
    expert gradients (None otherwise)."""
    la = cfg.layout
    apply_model_parallel(model, cfg, grid)
    loss_model = LossModel(model, grid, la.sp, cfg.train.compile)
    tp_sharded = tp_sharded_names(model, grid.size("tp"))
    if la.zero == 3:  # 6. data parallel: dense weights over dp x cp, experts over the ranks holding the same ones
        fsdp = FullyShardedDataParallel(loss_model, model, tp_sharded, grid.grad_group,
                                        grid.zero3_meshes(device.type), working_dtype(cfg, device))
        if is_meta(model):
            materialize_shards(model, grid, device, cfg.train.seed, root=loss_model)
        return loss_model, fsdp, None
    if is_meta(model):
        materialize_shards(model, grid, device, cfg.train.seed)
    dense, experts = bucketed_data_parallel(list(model.named_parameters()), tp_sharded, cfg, grid, bucket_bytes,
                                            param_dtype=working_dtype(cfg, device))
    return loss_model, dense, experts


def working_dtype(cfg: Config, device: torch.device | None) -> torch.dtype | None:
    """The dtype of the working weights under lean mixed precision (bf16 when the engine computes in bf16: the
    default on accelerators, `train.dtype = "bf16"` anywhere); None keeps fp32 parameters (the CPU default)."""
    return torch.bfloat16 if device is not None and use_bf16(cfg, device) else None


def bucketed_data_parallel(named: list[tuple[str, nn.Parameter]], tp_sharded: set[str], cfg: Config,
                           grid: ProcessGrid, bucket_bytes: int, own_bucket: frozenset[str] = frozenset(),
                           param_dtype: torch.dtype | None = None) -> (
    tuple[BucketedDataParallel, BucketedDataParallel | None]
):
    """Step 6 for ZeRO-0/1/2: the dense parameters' state over dp x cp and, under ep, the experts' over the ranks
    that hold the same experts; with `param_dtype` (bf16) the lean mixed precision of `parallel.data` (bf16
    working weights, fp32 master slices)."""
    la = cfg.layout
    experts = None
    if la.ep > 1:
        from fivefold.parallel.expert import is_expert_param

        experts = BucketedDataParallel([(n, p) for n, p in named if is_expert_param(n)], tp_sharded,
                                       grid.groups["edp"], la.zero, bucket_bytes, la.fp32_grad_accum,
                                       param_dtype=param_dtype)
        named = [(n, p) for n, p in named if not is_expert_param(n)]
    dense = BucketedDataParallel(named, tp_sharded, grid.grad_group, la.zero, bucket_bytes, la.fp32_grad_accum,
                                 own_bucket, param_dtype)
    return dense, experts


def parallelize_stages(stages: dict[int, Llama], cfg: Config, grid: ProcessGrid,
                       weight_grad_queue: WeightGradQueue | None, own_bucket: frozenset[str],
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | None = None) -> (
    tuple[LossModel | None, BucketedDataParallel, BucketedDataParallel | None]
):
    """The same order for this pipeline rank's stages: steps 1 to 5 on each, then the data-parallel states over
    all of their parameters (ZeRO-0/1/2; `own_bucket` names a tied weight that needs a bucket of its own).
    Returns the last stage's loss module (None when this rank does not hold it) and the two states."""
    from fivefold.parallel.pipeline import n_stages

    for stage in stages.values():
        apply_model_parallel(stage, cfg, grid, weight_grad_queue)
    first, last = stages.get(0), stages.get(n_stages(cfg.layout) - 1)
    for stage in stages.values():  # each rank allocates only its stages' shards
        if is_meta(stage):
            materialize_shards(stage, grid, device, cfg.train.seed)
    if cfg.model.tied_embeddings and first is not None and last is not None:
        last.lm_head.weight = first.embed.weight  # both on this rank (DualPipeV): one parameter again after tp
    named, seen = [], set()
    for stage in stages.values():
        for name, p in stage.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    tp_sharded = set().union(*(tp_sharded_names(stage, grid.size("tp")) for stage in stages.values()))
    dense, experts = bucketed_data_parallel(named, tp_sharded, cfg, grid, bucket_bytes, own_bucket,
                                            working_dtype(cfg, device))
    loss_model = LossModel(last, grid, cfg.layout.sp, cfg.train.compile) if last is not None else None
    return loss_model, dense, experts
