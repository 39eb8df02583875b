"""Apply the parallel techniques to a plain `Llama`, from outside and in one fixed order:

0. pipeline parallel (`layout.pp > 1`, before this module, by `pipeline.build_stages`): each rank keeps only its
   stages' blocks. Either way the model is a set of parts (the whole model is one part), steps 1 to 5 apply to
   each part (`apply_model_parallel`) and step 6 once to all of them (`apply_data_parallel`);
1. tensor parallel (with sequence parallel when `layout.sp`): shards the projections, the MLP/experts and
   the vocabulary over the tp ranks, in place, keeping every parameter name; under a zero-bubble pipeline
   schedule the linears then defer their weight gradients to the W pass (`pipeline.defer_weight_grads`);
2. expert parallel (`layout.ep`): keeps this rank's experts of each MoE layer (whole experts, already split
   along their ffn dim by tp) and routes tokens to them with all-to-alls over the ep group;
3. context parallel (`layout.cp`): attention becomes ring attention over the cp group, MoE statistics that
   span the sequence are summed over it; the engine feeds each rank its zig-zag chunks of every sequence;
4. activation recomputation (`layout.recompute`: none, selective = the attention core, full = each block);
5. `torch.compile` of each block (`train.compile`);
6. data parallel last, because it works on whatever parameters the steps before left (tp and ep shards), as
   one of the implementations of `data.DataParallel`: one device as `LocalDataParallel`, ZeRO-0/1/2 as flat
   gradient buckets with hooks, ZeRO-3 as `fully_shard` units per block (per stage under pipeline parallel). Dense
   gradients are reduced over dp x cp, expert gradients (under ep) over the ranks that hold the same experts.

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
from fivefold.layout import n_stages
from fivefold.models.llama import Llama, full_parameter_shapes, materialize
from fivefold.models.loss import model_loss_sum
from fivefold.parallel.data import (
    BucketedDataParallel,
    DataParallel,
    FullyShardedDataParallel,
    LocalDataParallel,
    dim0_shard,
)
from fivefold.parallel.mesh import ProcessGrid
from fivefold.parallel.pipeline_zero3 import PipelineFullyShardedDataParallel
from fivefold.parallel.schedules import stage_placement

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from fivefold.parallel.pipeline import WeightGradQueue


class LossModel(nn.Module):
    """The model and its loss as one module: `forward(inputs, targets, positions)` is the summed token loss of
    the rows (positions: the rotary positions of a context-parallel rank's tokens, None for 0..seq-1).

    Under tensor parallel the output layer and the cross-entropy are vocabulary-parallel (the full logits never
    exist); otherwise the fused chunked output layer + loss of the single-device engine. ZeRO-3's root unit
    wraps this module, so that its hooks run around the whole micro-batch."""

    def __init__(self, model: Llama, tp_group: ProcessGroup | None, sequence_parallel: bool,
                 compiled: bool = False) -> None:
        super().__init__()
        self.model, self.compiled = model, compiled
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel  # tp_group None: no tensor parallel
        self.compute_dtype = torch.float32

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> (
        torch.Tensor
    ):
        dtype = torch.bfloat16 if torch.is_autocast_enabled(inputs.device.type) else torch.float32
        if self.tp_group is None:  # the fused chunked output layer + loss
            return model_loss_sum(self.model, inputs, targets, positions, dtype, self.compiled)
        from fivefold.parallel.tensor import vocab_parallel_loss_sum

        hidden = self.model.forward_hidden(inputs, positions)
        return vocab_parallel_loss_sum(self.model, hidden, targets, self.tp_group, self.sequence_parallel,
                                       compute_dtype=dtype)


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def tp_sharded_names(model: nn.Module, tp: int, split_experts: bool = True) -> set[str]:
    """Names of the parameters split over tp (the others are replicated on every tp rank; the routed experts too
    unless `split_experts`, `layout.etp > 1`)."""
    if tp == 1:
        return set()
    from fivefold.parallel.tensor import tp_shard_dim

    return {name for name, _ in model.named_parameters() if tp_shard_dim(name, split_experts) is not None}


def norm_tp_sharded_names(model: nn.Module, cfg: Config, tp: int) -> set[str]:
    """Names of the parameters whose squared gradients a rank sums over tp for the global norm: those split over tp,
    and under ZeRO-3 with whole experts split over tp ranks' tokens (etp = 1) the routed experts, whose shards over
    the edp ranks (which span tp) are disjoint between tp ranks."""
    names = tp_sharded_names(model, tp, cfg.layout.splits_experts_over_tp)
    if cfg.layout.zero == 3 and cfg.layout.splits_tokens_over_tp:
        from fivefold.parallel.expert import is_expert_param

        names |= {name for name, _ in model.named_parameters() if is_expert_param(name)}
    return names


def apply_model_parallel(model: Llama, cfg: Config, grid: ProcessGrid | None,
                         weight_grad_queue: WeightGradQueue | None = None) -> None:
    """Steps 1 to 5 on one model part (the model, or a pipeline stage), in place (`grid` None: one device, where
    only float8, recompute and compile apply)."""
    la = cfg.layout
    tp, cp = (grid.size("tp"), grid.size("cp")) if grid is not None else (1, 1)
    if tp > 1:  # 1. tensor (and sequence) parallel
        from fivefold.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, grid.group("tp"), la.sp, split_experts=la.splits_experts_over_tp,
                              comm_overlap=la.overlaps_tp_comm)
    if cfg.train.float8 != "off":  # 1b. float8 linears, each on its tp shard
        from fivefold.parallel.float8 import apply_float8, gathers_float8

        apply_float8(model, cfg.train.float8, float8_all_gather=gathers_float8(cfg))
    if weight_grad_queue is not None:  # the zero-bubble schedules' B / W split
        from fivefold.parallel.pipeline import defer_weight_grads

        defer_weight_grads(model, weight_grad_queue)
    if la.ep > 1:  # 2. expert parallel
        from fivefold.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, grid.group("ep"))
    if cp > 1:  # 3. context parallel
        from fivefold.parallel.context import apply_context_parallel

        apply_context_parallel(model, grid.group("cp"))
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
        dim = tp_shard_dim(name, grid.layout.splits_experts_over_tp) if tp > 1 else None
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
    values as the one-process model's slices (`models.llama.draw_initial_values`): no rank allocates a full tensor.
    `root`: the outermost module to allocate from (ZeRO-3's root unit, which holds the model)."""
    materialize(model, device, seed, shard_regions(model, grid), root)


def working_dtype(cfg: Config, device: torch.device | None) -> torch.dtype | None:
    """The dtype of the working weights under lean mixed precision (bf16 when the engine computes in bf16: the
    default on accelerators, `train.dtype = "bf16"` anywhere); None keeps fp32 parameters (the CPU default)."""
    return torch.bfloat16 if device is not None and use_bf16(cfg, device) else None


def bucketed_data_parallel(named: list[tuple[str, nn.Parameter]], tp_sharded: set[str], cfg: Config,
                           grid: ProcessGrid, own_bucket: frozenset[str] = frozenset(),
                           param_dtype: torch.dtype | None = None) -> (
    tuple[BucketedDataParallel, BucketedDataParallel | None]
):
    """Step 6 for ZeRO-0/1/2: the dense parameters' state over dp x cp and, under ep, the experts' over the ranks
    that hold the same experts; with `param_dtype` (bf16) the lean mixed precision of `parallel.data` (bf16
    working weights, fp32 master slices). Buckets of `layout.dp_bucket_elements` elements; the parameter all-gather
    after the step overlapped with the next forward under `layout.dp_overlap_param_gather`."""
    la = cfg.layout
    options = {"bucket_elements": la.dp_bucket_elements, "fp32_grad_accum": la.fp32_grad_accum,
               "param_dtype": param_dtype, "overlap_param_gather": la.overlaps_param_gather}
    experts = None
    from fivefold.parallel.expert import is_expert_param

    routed = [(n, p) for n, p in named if is_expert_param(n)]
    if la.experts_apart and routed:
        experts = BucketedDataParallel(routed, tp_sharded, grid.group("edp"), la.zero, **options)
        named = [(n, p) for n, p in named if not is_expert_param(n)]
    dense = BucketedDataParallel(named, tp_sharded, grid.group("dp_cp"), la.zero, own_bucket=own_bucket, **options)
    return dense, experts


def apply_data_parallel(parts: dict[int, Llama], cfg: Config, grid: ProcessGrid | None, device: torch.device) -> (
    tuple[LossModel | None, list[DataParallel]]
):
    """Step 6, once, over this rank's model parts ({global stage: part}; the whole model is stage 0 of one), after
    steps 1 to 5: allocate this rank's shards of parts built on the meta device and return the loss module of the
    last stage (None when this rank does not hold it) and the data-parallel states, the one of the dense
    parameters first (under ZeRO-0/1/2 with expert parallel, the experts' second)."""
    la = cfg.layout
    last = parts.get(n_stages(la) - 1)
    tp_group = grid.group("tp") if grid is not None and grid.size("tp") > 1 else None
    loss_model = LossModel(last, tp_group, la.sp, cfg.train.compile) if last is not None else None
    if grid is None:  # one device: built in place, nothing to reduce
        (model,) = parts.values()
        return loss_model, [LocalDataParallel(model, working_dtype(cfg, device) is not None, la.fp32_grad_accum)]
    if la.zero == 3:
        tp_sharded = set().union(*(norm_tp_sharded_names(part, cfg, grid.size("tp")) for part in parts.values()))
        return loss_model, [fully_shard_parts(parts, loss_model, tp_sharded, cfg, grid, device)]
    tp_sharded = set().union(*(tp_sharded_names(part, grid.size("tp"), la.splits_experts_over_tp)
                               for part in parts.values()))
    for part in parts.values():  # each rank allocates only its parts' shards
        if is_meta(part):
            materialize_shards(part, grid, device, cfg.train.seed)
    first = parts.get(0)
    if cfg.model.tied_embeddings and la.pp > 1 and first is not None and last is not None:
        last.lm_head.weight = first.embed.weight  # both on this rank (DualPipeV): one parameter again after tp
    named, seen = [], set()
    for part in parts.values():
        for name, p in part.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    tied, counted = tied_copy(cfg, grid)
    dense, experts = bucketed_data_parallel(named, tp_sharded, cfg, grid, tied, working_dtype(cfg, device))
    if tied:
        dense.tie(tied, grid.group("embed"), counted)
    for dp in (dense, experts):
        if dp is not None:
            dp.waits_before(parts.values())
    return loss_model, [dense] + ([experts] if experts is not None else [])


def tied_copy(cfg: Config, grid: ProcessGrid) -> tuple[frozenset[str], bool]:
    """Under pipeline parallel with tied embeddings on two ranks: the name of this rank's copy of the weight (which
    gets a bucket of its own, its gradient summed with the other copy's) and whether this copy counts in the
    gradient norm (the first stage's does); (empty, True) otherwise."""
    la = cfg.layout
    if la.pp == 1 or not cfg.model.tied_embeddings:
        return frozenset(), True
    placement = stage_placement(la.schedule, la.pp, la.vpp)
    pp_rank = grid.ranks["pp"]
    if placement[0] == placement[-1]:
        return frozenset(), True
    names = {"embed.weight"} if pp_rank == placement[0] else {"lm_head.weight"} if pp_rank == placement[-1] else set()
    return frozenset(names), pp_rank == placement[0]


def fully_shard_parts(parts: dict[int, Llama], loss_model: LossModel | None, tp_sharded: set[str], cfg: Config,
                      grid: ProcessGrid, device: torch.device) -> DataParallel:
    """ZeRO-3 (and HSDP): `fully_shard` units over dp x cp (under expert parallel the routed experts over edp), then
    each rank allocates only its shards; the units of the whole model (root: the loss module), or of each pipeline
    stage (`pipeline_zero3`, each stage's copy of a tied weight initialised alike, the embedding's)."""
    meshes, dtype = grid.zero3_meshes(device.type), working_dtype(cfg, device)
    if cfg.layout.pp == 1:
        (model,) = parts.values()
        fsdp = FullyShardedDataParallel(loss_model, model, tp_sharded, grid.group("dp_cp"), meshes, dtype)
        if is_meta(model):
            materialize_shards(model, grid, device, cfg.train.seed, root=loss_model)
        return fsdp
    tied_group = grid.group("embed") if cfg.model.tied_embeddings else None
    sharded = PipelineFullyShardedDataParallel(parts, loss_model, n_stages(cfg.layout) - 1, tp_sharded,
                                               grid.group("dp_cp"), meshes, dtype, tied_group)
    for s, stage in parts.items():
        if is_meta(stage):
            materialize_shards(stage, grid, device, cfg.train.seed, root=sharded.roots[s])
    return sharded
