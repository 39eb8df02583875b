"""ZeRO-3 composed with pipeline parallel: each pipeline stage sharded by `fully_shard` (FSDP2) over its dp x cp
ranks, its weights gathered once per optimizer step and its gradients reduce-scattered once per step.

What is sharded: every parameter of every stage this pp rank holds (each virtual stage under interleaved and
DualPipeV), dim 0 split over the ranks that reduce gradients (dp x cp), as plain ZeRO-3
(`data.FullyShardedDataParallel`) does; each stage is one `fully_shard` unit per transformer block plus one unit
for the stage root (the embedding on the first stage, the final norm and output layer with the loss on the last),
with the same mixed-precision policy (bf16 all-gathers of the fp32 shards and fp32 reduce-scatters under lean
mixed precision). Under expert parallel each block is cut as plain ZeRO-3 cuts it (`data.shard_units`, shared by
both): the routed experts' weights of an MoE block shard over the edp ranks that hold the same experts (a unit of
their own over the edp mesh; plain tensors, ignored by the units, when edp = 1), the router and the shared experts
are small units over dp x cp.

What is communicated, per optimizer step and per unit: one all-gather (the stage's first forward of the step;
`reshard_after_forward=False` keeps the weights gathered across the micro-batches, as torchtitan does under PP)
and one reduce-scatter (the stage's last backward of the step). A pipeline rank runs its micro-batches' passes
interleaved, so plain ZeRO-3 would gather 2 x micro-batches times per step; here every backward but the stage's
last accumulates the unsharded gradient locally (`set_requires_gradient_sync(False)`, `set_reshard_after_backward
(False)`, `set_is_last_backward(False)`), and the last one reduce-scatters it and frees the gathered weights and
gradients. The price is memory: a stage's gathered weights and its unsharded gradients stay resident for the step
(the planner counts them, `planner.memory`).

The zero-bubble schedules (zero-bubble, DualPipeV) split backward into B (input gradients) and W (weight gradients,
`pipeline.WeightGradQueue`). The reduce-scatter runs inside the stage's last B, so before it the stage's pending W
work of the step is run and the last B computes its weight gradients at once (`WeightGradQueue.immediate`); the W
actions that follow find nothing left. The result is the same sum of gradients; only the last micro-batch's W work
moves into its B.

The tied embedding: the first and last stages each hold a copy of the weight (also when both are on one rank,
under DualPipeV, since one parameter cannot belong to two `fully_shard` roots); after the step's backward the two
copies' gradient shards are summed (over the `embed` group, or locally) and the output layer's copy is left out of
the gradient norm, so both copies take the same step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from fivefold.models.llama import Llama
from fivefold.parallel.data import ShardedState, shard_square_sums, shard_state_bytes, shard_units
from fivefold.parallel.mesh import Zero3Meshes
from fivefold.parallel.pipeline import WeightGradQueue


class PipelineFullyShardedDataParallel(ShardedState):
    """The data-parallel state (`data.DataParallel`) of a pipeline engine under ZeRO-3: the `fully_shard` units of
    this pp rank's stages (see the module docstring). `roots[s]` is stage s's root unit: `loss_model` for the last
    stage (whose forward computes the loss), the stage itself (its `forward_hidden`) otherwise."""

    zero = 3

    def __init__(self, stages: dict[int, Llama], loss_model: nn.Module | None, last_stage: int,
                 tp_sharded: set[str], group: ProcessGroup, meshes: Zero3Meshes,
                 param_dtype: torch.dtype | None = None, tied_group: ProcessGroup | None = None) -> None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        self.group, self.sync, self.tp_sharded, self.tied_group = group, True, tp_sharded, tied_group
        self.replicas = meshes.replicas
        self.stages = stages
        self.roots: dict[int, nn.Module] = {}
        self.units: dict[int, list[nn.Module]] = {}
        for s, stage in stages.items():  # each stage's units as plain ZeRO-3 builds them, kept gathered for the step
            root = loss_model if s == last_stage else stage
            units = shard_units(stage.layers.values(), root, meshes, param_dtype, reshard_after_forward=False)
            if root is stage:  # the engine calls forward_hidden: the root unit's hooks must run around it
                register_fsdp_forward_method(stage, "forward_hidden")
            self.roots[s], self.units[s] = root, units
        self.root = nn.ModuleList(self.roots.values())  # every unit of this rank under one module (checkpoints)
        # the tied embedding's copies on this rank: (embedding, output layer), either None where not held
        first, last = stages.get(0), stages.get(last_stage)
        self.tied = (first.embed.weight if first is not None and tied_group is not None else None,
                     last.lm_head.weight if last is not None and tied_group is not None else None)

    def n_units(self) -> int:
        """`fully_shard` units on this rank: one per block of each stage and one per stage root (under expert
        parallel also the router, the shared experts and, with edp > 1, the routed experts of each MoE block)."""
        return sum(len(units) for units in self.units.values())

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for root in self.roots.values():
            for p in root.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def optimizer_params(self) -> list[nn.Parameter]:
        return self.parameters()

    def set_last_backward(self, stage: int, last: bool) -> None:
        """Reduce-scatter the gradients and free the gathered weights in this backward of `stage` or not."""
        root = self.roots[stage]
        root.set_requires_gradient_sync(last)
        root.set_reshard_after_backward(last)
        root.set_is_last_backward(last)

    def reshard(self) -> None:
        """Free every gathered weight (after an evaluation forward, before checkpoint I/O touches the shards)."""
        for units in self.units.values():
            for unit in units:
                unit.reshard()

    def sum_tied_grads(self) -> None:
        """The embedding's and the output layer's gradients are one gradient: sum the two copies' shards."""
        embed, head = self.tied
        held = [p.grad.to_local() for p in (embed, head) if p is not None and p.grad is not None]
        if len(held) == 2:  # both copies on this rank (DualPipeV)
            held[0].add_(held[1])
            held[1].copy_(held[0])
        elif held and dist.get_world_size(self.tied_group) > 1:
            dist.all_reduce(held[0], group=self.tied_group)

    def expect_accumulations(self, uses) -> None:
        """No buckets to count gradient arrivals for."""

    reduces_now = False  # the stages' backwards have waited for their reduce-scatters

    def end_micro_batch(self) -> None:
        """The last backward of each stage has reduce-scattered its gradients."""

    def attach_grads(self) -> None:
        """The reduced gradient shards are already the parameters' `.grad`."""

    def after_step(self) -> None:
        """Parameters stay sharded; the next step's first forward gathers them."""

    def grad_square_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tp-sharded, replicated) squared-gradient sums of this pp rank's parameters, summed over dp x cp; the
        output layer's tied copy is left out (its gradient is the embedding's); `data.shard_square_sums`."""
        skip = id(self.tied[1]) if self.tied[1] is not None else None
        names = {id(p): name for stage in self.stages.values() for name, p in stage.named_parameters()}
        grads = ((names[id(p)] in self.tp_sharded, p.grad) for p in self.parameters()
                 if p.grad is not None and id(p) != skip)
        return shard_square_sums(grads, self.group, self.replicas)

    def state_bytes(self) -> dict[str, int]:
        return shard_state_bytes(self.parameters())


class ShardedStage:
    """A pipeline stage (`pipeline.PipelineStage`) under ZeRO-3: it tells the stage's `fully_shard` units which of
    the step's backwards is the last (the one that reduce-scatters), and under a split backward runs the stage's
    pending W work before it. The stage's output is sent in `wire_dtype` (the gathered bf16 weights make bf16
    activations; the receiving root casts them back, exactly)."""

    def __init__(self, runner, stage: int, data_parallel: PipelineFullyShardedDataParallel,
                 queue: WeightGradQueue | None, wire_dtype: torch.dtype) -> None:
        self.runner, self.stage, self.data_parallel, self.queue = runner, stage, data_parallel, queue
        self.wire_dtype = wire_dtype
        self.backwards_left = 0

    def __getattr__(self, name: str):  # the engine reads the runner's module, losses and drop counts
        return getattr(self.runner, name)

    def begin(self, micro_batches, global_tokens: int, training: bool) -> None:
        self.runner.begin(micro_batches, global_tokens, training)
        self.backwards_left = len(micro_batches) if training else 0

    def forward(self, micro_batch: int, x: torch.Tensor | None) -> torch.Tensor | None:
        y = self.runner.forward(micro_batch, x)
        return None if y is None else y.to(self.wire_dtype)

    def backward_input(self, micro_batch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        self.backwards_left -= 1
        last = self.backwards_left == 0
        self.data_parallel.set_last_backward(self.stage, last)
        if not last or self.queue is None:
            return self.runner.backward_input(micro_batch, grad_output)
        for key in [k for k in self.queue.pending if k[1] == self.stage]:  # W work must precede the reduce-scatter
            self.queue.run(key)
        with self.queue.immediately():
            return self.runner.backward_input(micro_batch, grad_output)

    def backward_weight(self, micro_batch: int) -> None:
        self.runner.backward_weight(micro_batch)
