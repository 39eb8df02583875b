"""The parallel engine: the single-device engine's contract (`fivefold.train.engine`) over a process grid,
driving the mechanisms of `fivefold.parallel` (applied to the model by `parallel.parallelize`).

It extends `Engine` (same set-up, same step) and differs from it in these places: `prepare_micro_batch` keeps
a context-parallel rank's zig-zag chunks of each sequence with their rotary positions; the loss goes through `LossModel`
(vocabulary parallel under tp); each micro-batch tells the data-parallel states whether to reduce gradients
(dense ones over dp x cp, expert ones over the ranks holding the same experts); the gradient norm is summed
over shards (tp-sharded parameters over tp, ZeRO slices over their group, experts over ep, replicated ones
counted once); logged values are summed over dp x cp; and for checkpoints each rank names the pieces of the
plain-model state it holds (`state_segments`), so that it writes only its own and loads them under any layout.

With pipeline parallel, `PipelineEngine` runs the schedule's actions over this rank's stages (`LlamaStage`, one
per stage, for `pipeline.PipelineExecutor`) instead of the micro-batch loop; see its docstring and
`fivefold.parallel.pipeline` for what it shards and communicates.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import Config
from fivefold.models.llama import Llama, build_model
from fivefold.parallel.data import (
    DEFAULT_BUCKET_BYTES,
    BucketedDataParallel,
    FullyShardedDataParallel,
    dim0_shard,
    full_value,
    hsdp_replica,
    load_shard,
    local_part,
)
from fivefold.parallel.mesh import ProcessGrid
from fivefold.parallel.parallelize import DataParallel, LossModel, parallelize, parallelize_stages
from fivefold.parallel.pipeline import (
    PipelineExecutor,
    WeightGradQueue,
    activation_dtype,
    build_stages,
    layer_ranges,
    stage_layer_counts,
)
from fivefold.parallel.pipeline_zero3 import PipelineFullyShardedDataParallel, ShardedStage, shard_stages
from fivefold.parallel.schedules import Schedule, build_schedule, forward_schedule, stage_placement
from fivefold.train.engine import Engine, Segment


class ParallelEngine(Engine):
    """Trains one rank's part of the model; `dp_rank`/`dp_size` select this rank's rows of the batch (every cp
    rank of a dp rank gets the same rows and keeps its chunks of them)."""

    def __init__(self, model: Llama, loss_model: LossModel, data_parallel: DataParallel, grid: ProcessGrid,
                 cfg: Config, device: torch.device, expert_data_parallel: BucketedDataParallel | None = None) -> None:
        self.loss_model, self.data_parallel, self.grid = loss_model, data_parallel, grid
        self.expert_data_parallel = expert_data_parallel
        self.data_parallels = [data_parallel] + ([expert_data_parallel] if expert_data_parallel else [])
        super().__init__(model, cfg, device)
        self.dp_rank, self.dp_size = grid.ranks["dp"], grid.size("dp")
        self.tp_rank, self.tp_size = grid.ranks["tp"], grid.size("tp")
        self.cp_rank, self.cp_size = grid.ranks["cp"], grid.size("cp")
        self.ep_rank, self.ep_size = grid.group_ranks["ep"].index(grid.rank), grid.size("ep")
        self.is_logging_rank = grid.rank == 0
        self.n_devices = grid.world_size

    def optimized_parameters(self) -> nn.Module:
        """This rank's share of the parameters as the data-parallel states hand them to the optimizer (ZeRO
        slices, tp and ep shards)."""
        return nn.ParameterList([p for dp in self.data_parallels for p in dp.optimizer_params()])

    def prepare_micro_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None
    ]:
        """Under context parallel, this cp rank's zig-zag chunks of every sequence and their rotary positions."""
        if self.cp_size == 1:
            return inputs, targets, None
        from fivefold.parallel.context import shard_batch

        return shard_batch(inputs, targets, self.cp_rank, self.cp_size)

    def loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        with self.autocast():
            return self.loss_model(inputs, targets, positions)

    @contextlib.contextmanager
    def micro_batch_context(self, index: int, count: int) -> Iterator[None]:
        for dp in self.data_parallels:
            dp.sync = index == count - 1
        yield
        for dp in self.data_parallels:
            dp.end_micro_batch()

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of the squared gradients of the whole model (every rank gets the same value)."""
        for dp in self.data_parallels:
            dp.attach_grads()
        sharded, replicated = self.data_parallel.grad_square_sums()
        if self.expert_data_parallel is not None:  # each ep rank holds other experts (and under tp, a slice)
            experts = sum(self.expert_data_parallel.grad_square_sums())
            dist.all_reduce(experts, group=self.grid.groups["ep"])
            sharded = sharded + experts
        if self.tp_size > 1:  # each tp rank holds a different slice of the sharded parameters
            dist.all_reduce(sharded, group=self.grid.tp_group)
        return sharded + replicated

    def grad_norm(self) -> torch.Tensor:
        return self.grad_square_sum().sqrt()

    def local_grads(self) -> list[torch.Tensor]:
        """The gradients of the parameters the optimizer steps (a ZeRO-3 shard's local slice)."""
        return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for dp in self.data_parallels for p in dp.optimizer_params() if p.grad is not None]

    def after_optimizer_step(self) -> None:
        for dp in self.data_parallels:
            dp.after_step()

    def agree(self, flags: torch.Tensor) -> torch.Tensor:
        """The maximum of `flags` over every rank (one all-reduce, no host sync)."""
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def reduce_for_logging(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data- and context-parallel ranks, which hold different tokens (tp ranks hold the same
        value)."""
        value = value.clone()
        dist.all_reduce(value, group=self.grid.grad_group)
        return value

    def moe_drop_fraction(self) -> float | None:
        """The mean over dp x cp ranks, which route equally many slots."""
        if self.drop_fraction is None:
            return None
        return float(self.reduce_for_logging(self.drop_fraction)) / dist.get_world_size(self.grid.grad_group)

    # --- state -----------------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        """This tp rank's parameters with plain names, unsharded over dp (the fp32 master values under lean mixed
        precision; collective then)."""
        state = self.model.state_dict()
        if isinstance(self.data_parallel, FullyShardedDataParallel):  # experts whole over edp stay plain tensors
            state = {name: full_value(t) for name, t in state.items()}
        return {**state, **self.master_state()}

    def master_state(self) -> dict[str, torch.Tensor]:
        """Under lean mixed precision, {plain name: this rank's whole tp/ep-local parameter in fp32} from the
        master slices (collective over the data-parallel groups); empty otherwise."""
        out = {}
        for dp in self.data_parallels:
            if isinstance(dp, BucketedDataParallel):
                out.update(dp.full_master_state())
        return out

    def master_pieces(self) -> list[tuple[str, int, torch.Tensor]]:
        """Under lean mixed precision, this rank's pieces of the fp32 master weights: (plain name, offset in the
        flattened tp/ep-local parameter, 1-D fp32 tensor); no communication. Empty otherwise."""
        return [piece for dp in self.data_parallels if isinstance(dp, BucketedDataParallel)
                for piece in dp.master_pieces()]

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the fp32 master slices from a plain-named state of this rank's tp/ep-local parameters."""
        for dp in self.data_parallels:
            if isinstance(dp, BucketedDataParallel):
                dp.load_master(state)

    def _gathered_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters with plain names, whole over tp and ep (collective over those groups)."""
        state = self._local_state()
        if self.tp_size > 1:
            from fivefold.parallel.tensor import gather_state

            state = gather_state(state, self.grid.tp_group)
        if self.ep_size > 1:
            from fivefold.parallel.expert import gather_expert_state

            state = gather_expert_state(state, self.grid.groups["ep"])
        return state

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The full plain-named state on every rank (collective: every rank must call it)."""
        return self._gathered_state()

    def _sharded_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tp and ep shards of a plain state (the reverse of `_gathered_state`)."""
        if self.tp_size > 1:
            from fivefold.parallel.tensor import shard_state

            state = shard_state(state, self.tp_rank, self.tp_size)
        if self.ep_size > 1:
            from fivefold.parallel.expert import shard_expert_state

            state = shard_expert_state(state, self.ep_rank, self.ep_size)
        return state

    @torch.no_grad()
    def load_full_model_state(self, state: dict[str, torch.Tensor]) -> None:
        state = self._sharded_state(state)
        if isinstance(self.data_parallel, FullyShardedDataParallel):
            own = self.model.state_dict()
            missing = set(own) ^ set(state)
            if missing:
                raise KeyError(f"model state keys differ: {sorted(missing)}")
            for name, param in own.items():  # dim 0 over each parameter's own mesh (dp x cp, or edp for experts)
                load_shard(param, state[name])
            return
        self.model.load_state_dict(state, strict=True)  # copies in place: bucket views stay views
        self.load_master_state(state)

    # --- sharded checkpoints ---------------------------------------------------------------------
    def named_plain_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters with their plain-model names (tp, ep or ZeRO-3 local parts)."""
        return list(self.model.named_parameters())

    def _global_shapes(self) -> dict[str, tuple[int, ...]]:
        if not hasattr(self, "_shapes"):
            meta = build_model(self.cfg.model, device="meta").state_dict()
            self._shapes = {n: tuple(t.shape) for n, t in meta.items()}
        return self._shapes

    def _placed(self, name: str, local_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """(global shape, offsets of this rank's tp/ep part in it, whether this rank is its first tp replica):
        a dim smaller than the global one is split over ep (dim 0 of an expert weight) or tp."""
        from fivefold.parallel.expert import is_expert_param

        shape = self._global_shapes()[name]
        offsets, tp_split = [], False
        for d, (local, full) in enumerate(zip(local_shape, shape, strict=True)):
            if local == full:
                offsets.append(0)
            elif d == 0 and is_expert_param(name) and self.ep_size > 1 and local * self.ep_size == full:
                offsets.append(self.ep_rank * local)
            else:
                offsets.append(self.tp_rank * local)
                tp_split = True
        return shape, tuple(offsets), tp_split or self.tp_rank == 0

    def state_segments(self) -> list[Segment]:
        """This rank's tp/ep parts of the parameters, cut as its ZeRO stage holds them: whole (ZeRO-0, written by
        the first dp x cp rank), the flat slices of each bucket (ZeRO-1/2) or dim-0 shards (ZeRO-3)."""
        named = self.named_plain_parameters()
        segments = []
        if self.data_parallel.zero == 3:  # fully_shard, alone or over pipeline stages (`pipeline_zero3`)
            from torch.distributed.fsdp import FSDPModule

            for module in self.data_parallel.root.modules():  # an evaluation forward leaves the root unsharded
                if isinstance(module, FSDPModule):
                    module.reshard()
            named = self.named_plain_parameters()
            for name, p in named:
                shape, offsets, first = self._placed(name, tuple(p.shape))
                local = local_part(p)  # experts whole over edp = 1 are plain tensors
                index, chunks = dim0_shard(p)  # fully_shard splits dim 0 over its mesh as torch.chunk does
                rows = -(-p.shape[0] // chunks)
                offsets = (offsets[0] + min(index * rows, p.shape[0]), *offsets[1:])
                # under HSDP each replica holds the same shard: the first replica writes it
                segments.append(Segment(name, shape, offsets, tuple(local.shape), 0, local.numel(),
                                        local.detach().view(-1), p, 0, first and hsdp_replica(p) == 0))
            return segments
        names = {id(p): n for n, p in named}
        for dp in self.data_parallels:
            master = getattr(dp, "master", False)  # lean mixed precision: the fp32 masters are the weights saved
            for bucket in dp.buckets:
                lo, hi = dp.shard_range(bucket)
                for p, off in zip(bucket.params, bucket.offsets, strict=True):
                    name = names[id(p)]
                    shape, offsets, first = self._placed(name, tuple(p.shape))
                    if dp.zero == 0 and not master:
                        segments.append(Segment(name, shape, offsets, tuple(p.shape), 0, p.numel(),
                                                p.detach().view(-1), p, 0, first and dp.dp_rank == 0))
                        continue
                    a, b = max(lo, off) - off, min(hi, off + p.numel()) - off
                    if a < b:
                        weight = (bucket.shard.detach().view(-1)[off + a - lo:off + b - lo] if master
                                  else bucket.flat_params[off + a:off + b])
                        segments.append(Segment(name, shape, offsets, tuple(p.shape), a, b, weight, bucket.shard,
                                                off + a - lo, first and (dp.zero >= 1 or dp.dp_rank == 0)))
        return segments

    def after_state_load(self) -> None:
        """ZeRO-1/2: each rank loaded its slice of the flat weights; all-gather the rest as after a step. Under lean
        mixed precision the loaded values are the fp32 masters: cast them to the working weights likewise."""
        for dp in self.data_parallels:
            if getattr(dp, "zero", 0) in (1, 2) or getattr(dp, "master", False):  # masters cast to the weights
                dp.after_step()

    def barrier(self) -> None:
        dist.barrier()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (Adam's two moments, and the fp32
        master slices under lean mixed precision)."""
        held = self.data_parallel.state_bytes()
        if self.expert_data_parallel is not None:
            held = {k: v + self.expert_data_parallel.state_bytes()[k] for k, v in held.items()}
        # the fp32 master slices of lean mixed precision count with the optimizer (the playbook's k = 12)
        optimizer = sum(dp.master_bytes() for dp in self.data_parallels if isinstance(dp, BucketedDataParallel))
        for s in self.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in s:
                    t = s[key].to_local() if hasattr(s[key], "to_local") else s[key]
                    optimizer += t.numel() * t.element_size()
        return {**held, "optimizer": optimizer}


class LlamaStage:
    """One pipeline stage of the Llama as the executor sees it (`pipeline.PipelineStage`): F runs the stage's
    blocks (the first stage from the tokens, the last one through the loss), B backpropagates from the output
    gradient (the last stage from its loss), W drains the deferred weight gradients.

    The last stage's loss is the micro-batch's summed token loss divided by the global batch's token count, as in
    the one-process engine; each stage adds its own MoE layers' load-balancing loss (times the coefficient and the
    micro-batch's token share) to what it backpropagates."""

    def __init__(self, module: Llama, loss_model: LossModel | None, stage: int, n_stages: int,
                 queue: WeightGradQueue | None, engine: PipelineEngine) -> None:
        self.module, self.loss_model, self.stage, self.queue, self.engine = module, loss_model, stage, queue, engine
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.saved: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def begin(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], global_tokens: int,
              training: bool) -> None:
        """The step's prepared micro-batches (this rank's inputs, targets and rotary positions of each)."""
        self.micro_batches, self.global_tokens, self.training = micro_batches, global_tokens, training
        device = micro_batches[0][0].device
        # evaluation sums in float64, as the one-process evaluation does
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float32 if training else torch.float64)
        self.drop_sum = torch.zeros((), device=device)

    def forward(self, micro_batch: int, x: torch.Tensor | None) -> torch.Tensor | None:
        inputs, targets, positions = self.micro_batches[micro_batch]
        if self.first:
            x = inputs
        elif self.training:
            x.requires_grad_()
        with self.engine.autocast():
            if self.last:
                loss_sum = self.loss_model(x, targets, positions)
                self.loss_sum += loss_sum.detach()
                out = loss_sum / self.global_tokens
            else:
                out = self.module.forward_hidden(x, positions)
        if self.training:
            roots = [out]
            aux = self.module.moe_aux_loss()
            if aux is not None:  # token-weighted mean of the load-balancing loss over the global batch
                roots.append(self.engine.cfg.model.aux_loss_coef * aux * targets.numel() / self.global_tokens)
                if self.engine.cfg.model.capacity_factor > 0:
                    self.drop_sum += self.module.moe_drop_fraction().detach() * len(self.module.layers)
            self.saved[micro_batch] = (x, roots)
        return None if self.last else out

    def backward_input(self, micro_batch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        x, roots = self.saved.pop(micro_batch)
        grads = [grad_output] + [None] * (len(roots) - 1)
        with self.queue.collect((micro_batch, self.stage)) if self.queue is not None else contextlib.nullcontext():
            torch.autograd.backward(roots, grads)
        return None if self.first else x.grad

    def backward_weight(self, micro_batch: int) -> None:
        if self.queue is not None:
            self.queue.run((micro_batch, self.stage))


class PipelineEngine(ParallelEngine):
    """The parallel engine over pipeline stages: `forward_backward` runs this rank's action list of the schedule
    (`layout.schedule`) through `PipelineExecutor`; evaluation runs the forward-only pipeline.

    What differs from `ParallelEngine`: the data-parallel buckets are reduced once per step, each as soon as the
    last micro-batch's gradient of its parameters arrives (micro-batches interleave); with tied embeddings on two
    ranks, the two copies' reduced gradients are summed over the `embed` group (first and last pipeline rank)
    and counted once in the norm; the gradient norm and the logged losses are summed over pp; checkpoints
    gather every stage's parameters over pp (and tp and ep) into the plain model's state."""

    def __init__(self, stages: dict[int, Llama], loss_model: LossModel | None, data_parallel: BucketedDataParallel,
                 expert_data_parallel: BucketedDataParallel | None, grid: ProcessGrid, cfg: Config,
                 device: torch.device, counts: list[int], queue: WeightGradQueue | None,
                 tied_bucket_names: frozenset[str]) -> None:
        super().__init__(nn.ModuleDict({str(s): m for s, m in stages.items()}), loss_model, data_parallel, grid,
                         cfg, device, expert_data_parallel)
        la = cfg.layout
        self.stages, self.counts, self.queue = stages, counts, queue
        self.pp_rank, self.pp_size = grid.ranks["pp"], grid.size("pp")
        self.pp_group = grid.groups["pp"]
        self.placement = stage_placement(la.schedule, la.pp, la.vpp)
        self.n_stages = len(self.placement)
        self.runners = {s: LlamaStage(m, loss_model if s == self.n_stages - 1 else None, s, self.n_stages, queue,
                                      self) for s, m in stages.items()}
        # gradient accumulations of each parameter per micro-batch: 2 for a weight tied on one rank (DualPipeV)
        self.uses = collections.Counter(id(p) for m in stages.values() for p in m.parameters())
        self.expected_micro_batches = 0  # the micro-batch count the buckets' expectations were set for
        tied = {id(p) for m in stages.values() for n, p in m.named_parameters() if n in tied_bucket_names}
        self.tied_buckets = [b for b in data_parallel.buckets if any(id(p) in tied for p in b.params)]
        if self.pp_rank != self.placement[0]:  # the output layer's copy: the first rank counts it in the norm
            for b in self.tied_buckets:
                b.count_in_norm = False
        self.schedules: dict[tuple[int, bool], Schedule] = {}
        self.traces: dict[bool, list] = {}  # what the executor ran in the last training / evaluation step

    def schedule(self, m: int, training: bool = True) -> Schedule:
        la = self.cfg.layout
        if (m, training) not in self.schedules:
            make = build_schedule if training else forward_schedule
            self.schedules[(m, training)] = make(la.schedule, la.pp, m, la.vpp)
        return self.schedules[(m, training)]

    def _run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int,
             training: bool) -> torch.Tensor:
        """Run the (training or forward-only) schedule over the micro-batches; this rank's summed token loss (zero
        but on the rank of the last stage)."""
        prepared = []
        for inputs, targets in micro_batches:
            inputs, targets, positions = self.prepare_micro_batch(inputs, targets)
            if positions is None:  # later stages see hidden states (sequence-sharded under SP): say where they are
                positions = torch.arange(inputs.shape[1], device=inputs.device)
            prepared.append((inputs, targets, positions))
        rows, local_seq = prepared[0][0].shape
        shape = (rows, local_seq // self.tp_size if self.cfg.layout.sp else local_seq, self.cfg.model.hidden)
        for runner in self.runners.values():
            runner.begin(prepared, global_tokens, training)
        dtype = activation_dtype([runner.module for runner in self.runners.values()], self.bf16)
        executor = PipelineExecutor(self.pp_group, self.pp_rank, shape, dtype, self.device)
        executor.run(self.schedule(len(micro_batches), training), self.runners)
        self.traces[training] = executor.trace
        if training and self.cfg.model.capacity_factor > 0:  # this rank's layers' share of the mean over all MoE layers
            drops = sum(runner.drop_sum for runner in self.runners.values())
            self.drop_fraction = drops / (len(micro_batches) * self.cfg.model.n_layers)
        last = self.runners.get(self.n_stages - 1)
        return last.loss_sum if last is not None else torch.zeros((), device=self.device)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int) -> (
        torch.Tensor
    ):
        m = len(micro_batches)
        for dp in self.data_parallels:
            dp.sync = True
            if m != self.expected_micro_batches:  # the buckets' completion counts depend on m only
                dp.expect_accumulations(lambda p: m * self.uses[id(p)])
        self.expected_micro_batches = m
        total = self._run(micro_batches, global_tokens, training=True)
        for dp in self.data_parallels:
            dp.end_micro_batch()  # reduce what the hooks did not start, and wait
        for bucket in self.tied_buckets:  # the embedding's and the output layer's gradients are one gradient
            dist.all_reduce(self.data_parallel.reduced_grad(bucket), group=self.grid.groups["embed"])
        return total

    @torch.no_grad()
    def eval_micro_batches(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self._run(micro_batches, 1, training=False)

    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.eval_micro_batches([(inputs, targets)])

    def grad_square_sum(self) -> torch.Tensor:
        total = super().grad_square_sum()
        dist.all_reduce(total, group=self.pp_group)  # each pp rank holds other parameters
        return total

    def reduce_for_logging(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks and the pipeline ranks (only the last stage's is not zero)."""
        value = super().reduce_for_logging(value)
        dist.all_reduce(value, group=self.pp_group)
        return value

    # --- state -----------------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        state = {name: t for m in self.stages.values() for name, t in m.state_dict().items()}
        master = self.master_state()
        return {**state, **{name: t for name, t in master.items() if name in state}}

    def _owner(self, name: str) -> int:
        """The pp rank that holds plain-model parameter `name`."""
        placement = self.placement
        if name.startswith("embed."):
            return placement[0]
        if name.startswith("layers."):
            index = int(name.split(".")[1])
            stage = next(s for s, r in enumerate(layer_ranges(self.counts)) if index in r)
            return placement[stage]
        return placement[-1]  # final norm, output layer

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The full plain-named state on every rank (a tied output layer left out): each stage's parameters (whole
        over tp and ep) broadcast from their pp rank over the pp group (collective: every rank must call it)."""
        mine = self._gathered_state()
        full = {}
        for name, meta in build_model(self.cfg.model, device="meta").state_dict().items():
            if name == "lm_head.weight" and self.cfg.model.tied_embeddings:
                continue
            owner = self._owner(name)
            tensor = mine[name] if owner == self.pp_rank else torch.empty(meta.shape, dtype=meta.dtype,
                                                                          device=self.device)
            tensor = tensor.detach().contiguous()
            dist.broadcast(tensor, group=self.pp_group, group_src=owner)
            full[name] = tensor
        return full

    @torch.no_grad()
    def load_full_model_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self._local_state()
        missing = set(own) - set(state)
        if missing:
            raise KeyError(f"model state lacks {sorted(missing)}")
        state = self._sharded_state({name: state[name] for name in own})
        for m in self.stages.values():  # copies in place: bucket views stay views
            m.load_state_dict({name: state[name] for name in m.state_dict()}, strict=True)
        self.load_master_state(state)

    def named_plain_parameters(self) -> list[tuple[str, nn.Parameter]]:
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for m in self.stages.values():
            for name, p in m.named_parameters():
                if id(p) not in named or name == "embed.weight":  # a weight tied on one rank: the embedding's name
                    named[id(p)] = (name, p)
        return list(named.values())


class ShardedPipelineEngine(PipelineEngine):
    """The pipeline engine under ZeRO-3 (`parallel.pipeline_zero3`): each stage's runner is wrapped so that only its
    last backward of the step reduce-scatters; the tied embedding's copies are summed as gradient shards; states
    are gathered from (and loaded into) the dim-0 shards of `fully_shard`, each over its own mesh (dp x cp, or
    edp for the experts under expert parallel; experts whole over edp = 1 are plain tensors)."""

    def __init__(self, stages: dict[int, Llama], loss_model: LossModel | None,
                 data_parallel: PipelineFullyShardedDataParallel, grid: ProcessGrid, cfg: Config, device: torch.device,
                 counts: list[int], queue: WeightGradQueue | None) -> None:
        super().__init__(stages, loss_model, data_parallel, None, grid, cfg, device, counts, queue, frozenset())
        wire = activation_dtype(list(stages.values()), self.bf16)
        self.runners = {s: ShardedStage(runner, s, data_parallel, queue, wire) for s, runner in self.runners.items()}

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int) -> (
        torch.Tensor
    ):
        total = self._run(micro_batches, global_tokens, training=True)
        self.data_parallel.sum_tied_grads()
        return total

    @torch.no_grad()
    def eval_micro_batches(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        loss = self._run(micro_batches, 1, training=False)
        self.data_parallel.reshard()  # the weights stay gathered after a forward: free them
        return loss

    def _local_state(self) -> dict[str, torch.Tensor]:
        self.data_parallel.reshard()
        return {name: full_value(t) for m in self.stages.values() for name, t in m.state_dict().items()}

    @torch.no_grad()
    def load_full_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.data_parallel.reshard()  # the gathered copies would be stale
        own = {name: t for m in self.stages.values() for name, t in m.state_dict().items()}
        missing = set(own) - set(state)
        if missing:
            raise KeyError(f"model state lacks {sorted(missing)}")
        state = self._sharded_state({name: state[name] for name in own})
        for name, t in own.items():  # dim 0 over each parameter's own mesh (dp x cp, or edp for experts)
            load_shard(t, state[name])


def create_pipeline_engine(cfg: Config, grid: ProcessGrid, device: torch.device,
                           bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PipelineEngine:
    """This rank's stages of the full model (built from the seed), the layout applied to each, and the engine."""
    la = cfg.layout
    counts = stage_layer_counts(cfg)
    placement = stage_placement(la.schedule, la.pp, la.vpp)
    pp_rank = grid.ranks["pp"]
    # on the meta device: parallelize_stages allocates only this rank's shards of its stages
    stages = build_stages(cfg.model, counts, placement, pp_rank, torch.device("meta"), cfg.train.seed)
    split = build_schedule(la.schedule, la.pp, cfg.grad_accum_steps, la.vpp).split_backward
    queue = WeightGradQueue() if split else None
    if la.zero == 3:
        loss_model, sharded = shard_stages(stages, cfg, grid, queue, device)
        return ShardedPipelineEngine(stages, loss_model, sharded, grid, cfg, device, counts, queue)
    tied_names: frozenset[str] = frozenset()
    if cfg.model.tied_embeddings and placement[0] != placement[-1]:
        tied_names = frozenset({"embed.weight"} if pp_rank == placement[0] else
                               {"lm_head.weight"} if pp_rank == placement[-1] else set())
    loss_model, data_parallel, expert_data_parallel = parallelize_stages(stages, cfg, grid, queue, tied_names,
                                                                         bucket_bytes, device)
    return PipelineEngine(stages, loss_model, data_parallel, expert_data_parallel, grid, cfg, device, counts, queue,
                          tied_names)


def create_parallel_engine(cfg: Config, device: torch.device,
                           bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ParallelEngine:
    """Validate the layout against the initialised world, build the grid, the plain model on the meta device,
    apply the layout (allocating only this rank's shards, initialised from the seed as one process would) and
    return the engine (the pipeline engine when layout.pp > 1)."""
    grid = ProcessGrid.build(cfg)
    if cfg.layout.pp > 1:
        return create_pipeline_engine(cfg, grid, device, bucket_bytes)
    # on the meta device: parallelize allocates only this rank's shards (no rank holds the full model)
    model = build_model(cfg.model, device="meta")
    loss_model, data_parallel, expert_data_parallel = parallelize(model, cfg, grid, device, bucket_bytes)
    return ParallelEngine(model, loss_model, data_parallel, grid, cfg, device, expert_data_parallel)
