"""The two step runners of the engine, chosen once when it is built (as Megatron chooses its forward-backward
function): `MicroBatchLoop` runs the micro-batches one after the other (forward, backward, and the data-parallel
reductions of the last one); `PipelineSchedule` runs this rank's action list of the pipeline schedule
(`layout.schedule`) over its stages (`LlamaStage`, one per stage, for `pipeline.PipelineExecutor`). Both keep the
contract of `fivefold.train.engine`: every micro-batch's summed token loss is divided by the global batch's token
count before backward, and `forward_backward` returns this rank's summed token loss.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from fivefold import faults
from fivefold.config import Config
from fivefold.models.llama import Llama
from fivefold.parallel.parallelize import LossModel
from fivefold.parallel.pipeline import PipelineExecutor, PipelineStage, WeightGradQueue, activation_dtype
from fivefold.parallel.schedules import Schedule, build_schedule, forward_schedule

if TYPE_CHECKING:
    from fivefold.train.engine import Engine

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]



def router_loss_share(cfg: Config, router_loss: torch.Tensor, tokens: int) -> torch.Tensor:
    """A micro-batch's share of the router's losses in the step's loss: their token-weighted mean over every token of
    the global batch (`tokens` of this micro-batch; the router sees every token, whether or not its target is
    trained, so the weights sum to one however many targets document masking leaves)."""
    t = cfg.train
    return router_loss * tokens / (t.global_batch_size * t.seq_len)


class StepRunner(Protocol):
    """How the engine runs one step's micro-batches."""

    splits_micro_batches: bool  # a micro-batch can be run (and timed) alone through `Engine.micro_batch_loss`

    def forward_backward(self, engine: Engine, micro_batches: MicroBatches, global_tokens: int) -> torch.Tensor:
        """Forward and backward of every micro-batch; this rank's summed token loss."""

    def eval_micro_batches(self, engine: Engine, micro_batches: MicroBatches) -> torch.Tensor:
        """Summed token loss over the micro-batches, forward only."""

    def eval_loss_sum(self, engine: Engine, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss of this rank's part of a batch of whole sequences."""


class MicroBatchLoop:
    """The micro-batches one after the other; data parallel reduces on the last (`Engine.micro_batch_context`)."""

    splits_micro_batches = True

    def forward_backward(self, engine: Engine, micro_batches: MicroBatches, global_tokens: int) -> torch.Tensor:
        total = torch.zeros((), device=engine.device)
        drops = []
        capacity = engine.cfg.model.capacity_factor > 0  # only capacity-based routing drops, so only it is logged
        for i, (inputs, targets) in enumerate(micro_batches):
            faults.note(micro_batch=i, action="forward-backward")
            with engine.micro_batch_context(i, len(micro_batches)):
                loss, loss_sum = engine.micro_batch_loss(inputs, targets, global_tokens)
                loss.backward()
            total += loss_sum
            drop = engine.model.moe_drop_fraction() if capacity else None
            if drop is not None:
                drops.append(drop.detach())
        engine.drop_fraction = torch.stack(drops).mean() if drops else None
        return total

    def eval_micro_batches(self, engine: Engine, micro_batches: MicroBatches) -> torch.Tensor:
        total = torch.zeros((), device=engine.device, dtype=torch.float64)
        for inputs, targets in micro_batches:
            total += engine.eval_loss_sum(inputs, targets).double()
        return total

    def eval_loss_sum(self, engine: Engine, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return engine.loss_sum(*engine.prepare_micro_batch(inputs, targets))


class LlamaStage:
    """One pipeline stage of the Llama as the executor sees it (`pipeline.PipelineStage`): F runs the stage's
    blocks (the first stage from the tokens, the last one through the loss), B backpropagates from the output
    gradient (the last stage from its loss), W drains the deferred weight gradients.

    The last stage's loss is the micro-batch's summed token loss divided by the global batch's token count, as in
    the one-process engine; each stage adds its own MoE layers' load-balancing loss (times the coefficient and the
    micro-batch's token share) to what it backpropagates."""

    def __init__(self, module: Llama, loss_model: LossModel | None, stage: int, n_stages: int,
                 queue: WeightGradQueue | None, cfg: Config,
                 autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.module, self.loss_model, self.stage, self.queue = module, loss_model, stage, queue
        self.cfg, self.autocast = cfg, autocast
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
        with self.autocast():
            if self.last:
                loss_sum = self.loss_model(x, targets, positions)
                self.loss_sum += loss_sum.detach()
                out = loss_sum / self.global_tokens
            else:
                out = self.module.forward_hidden(x, positions)
        if self.training:
            roots = [out]
            router_loss = self.module.moe_router_loss()
            if router_loss is not None:
                roots.append(router_loss_share(self.cfg, router_loss, targets.numel()))
                if self.cfg.model.capacity_factor > 0:
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


class PipelineSchedule:
    """This rank's action list of the schedule (`layout.schedule`) through `PipelineExecutor`; evaluation runs the
    forward-only pipeline. The data-parallel states reduce once per step, a bucket as soon as the last
    micro-batch's gradient of its parameters arrives (micro-batches interleave; `expect_accumulations`), and a
    tied weight's two copies' reduced gradients are summed after the step's backward (`sum_tied_grads`).

    `stages`: this rank's stages {global stage: module}; `runners`: what the executor runs of each (a `LlamaStage`,
    wrapped under ZeRO-3 by `pipeline_zero3.ShardedStage`)."""

    splits_micro_batches = False

    def __init__(self, stages: dict[int, Llama], runners: dict[int, PipelineStage], counts: list[int],
                 placement: tuple[int, ...], queue: WeightGradQueue | None, cfg: Config) -> None:
        self.stages, self.runners, self.counts, self.placement, self.queue = stages, runners, counts, placement, queue
        self.cfg = cfg
        self.n_stages = len(placement)
        # gradient accumulations of each parameter per micro-batch: 2 for a weight tied on one rank (DualPipeV)
        self.uses = collections.Counter(id(p) for m in stages.values() for p in m.parameters())
        self.expected_micro_batches = 0  # the micro-batch count the buckets' expectations were set for
        self.schedules: dict[tuple[int, bool], Schedule] = {}
        self.traces: dict[bool, list] = {}  # what the executor ran in the last training / evaluation step

    def schedule(self, m: int, training: bool = True) -> Schedule:
        la = self.cfg.layout
        if (m, training) not in self.schedules:
            self.schedules[(m, training)] = (
                build_schedule(la.schedule, la.pp, m, la.vpp, overlap_fb=la.overlaps_fb,
                               pair_w=la.fb_pairs_run_w)
                if training else forward_schedule(la.schedule, la.pp, m, la.vpp))
        return self.schedules[(m, training)]

    def _run(self, engine: Engine, micro_batches: MicroBatches, global_tokens: int, training: bool) -> torch.Tensor:
        """Run the (training or forward-only) schedule over the micro-batches; this rank's summed token loss (zero
        but on the rank of the last stage)."""
        prepared = []
        for inputs, targets in micro_batches:
            inputs, targets, positions = engine.prepare_micro_batch(inputs, targets)
            if positions is None:  # later stages see hidden states (sequence-sharded under SP): say where they are
                positions = torch.arange(inputs.shape[1], device=inputs.device)
            prepared.append((inputs, targets, positions))
        rows, local_seq = prepared[0][0].shape
        shape = (rows, local_seq // engine.tp_size if self.cfg.layout.sp else local_seq, self.cfg.model.hidden)
        for runner in self.runners.values():
            runner.begin(prepared, global_tokens, training)
        dtype = activation_dtype(list(self.stages.values()), engine.bf16)
        executor = PipelineExecutor(engine.pp_group, engine.pp_rank, shape, dtype, engine.device,
                                    overlap=self.cfg.layout.overlaps_pp_comm, channels=engine.pp_channels)
        executor.run(self.schedule(len(micro_batches), training), self.runners)
        self.traces[training] = executor.trace
        if training and self.cfg.model.capacity_factor > 0:  # this rank's layers' share of the mean over all MoE layers
            drops = sum(runner.drop_sum for runner in self.runners.values())
            engine.drop_fraction = drops / (len(micro_batches) * self.cfg.model.n_layers)
        last = self.runners.get(self.n_stages - 1)
        return last.loss_sum if last is not None else torch.zeros((), device=engine.device)

    def forward_backward(self, engine: Engine, micro_batches: MicroBatches, global_tokens: int) -> torch.Tensor:
        m = len(micro_batches)
        for dp in engine.data_parallels:
            dp.sync = True
            if m != self.expected_micro_batches:  # the buckets' completion counts depend on m only
                dp.expect_accumulations(lambda p: m * self.uses[id(p)])
        self.expected_micro_batches = m
        total = self._run(engine, micro_batches, global_tokens, training=True)
        with engine.waits():
            for dp in engine.data_parallels:
                dp.end_micro_batch()  # reduce what the hooks did not start, and wait
        for dp in engine.data_parallels:
            dp.sum_tied_grads()  # the embedding's and the output layer's gradients are one gradient
        return total

    def eval_micro_batches(self, engine: Engine, micro_batches: MicroBatches) -> torch.Tensor:
        loss = self._run(engine, micro_batches, 1, training=False)
        for dp in engine.data_parallels:
            dp.reshard()  # the weights a forward left gathered: free them
        return loss

    def eval_loss_sum(self, engine: Engine, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.eval_micro_batches(engine, [(inputs, targets)])


def stage_modules(stages: dict[int, Llama]) -> nn.Module:
    """This rank's stages as one module (the engine's `model` under pipeline parallel)."""
    return nn.ModuleDict({str(s): m for s, m in stages.items()})
