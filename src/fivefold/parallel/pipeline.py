"""Pipeline parallel: the blocks split into stages over the pp ranks, and the executor that runs a schedule's
per-rank action list (`schedules.build_schedule`) on them.

What is sharded: the blocks, whole. Global stage s (0 .. n_stages - 1, in model order) holds a consecutive run
of blocks; the first stage also holds the embedding, the last the final norm and the output layer (and computes
the loss). There are pp stages, pp x vpp under the interleaved schedule and 2 pp under DualPipeV, and the rank of
each is `schedules.stage_placement` (rank r holds r, r + pp, ... when interleaved; r and 2 pp - 1 - r in the V of
DualPipeV, so that rank 0 holds the first and the last stage). The blocks per stage are balanced by training
FLOPs (`flops.balanced_stage_layers`, the planner's split too: the last stage's output layer and loss count as a
fraction of a block, the embedding lookup as none), or given explicitly as `layout.stage_layers`. Every rank
describes the full model on the meta device and keeps only its stages, which it allocates (after tensor and expert
parallel have shrunk them to its shards) with the one-process model's initial values (`models.llama.draw_initial_values`
depends on the seed and the parameter name, not the layout): each stage is the plain `Llama` with the other blocks
removed (blocks keep their global index, so parameter names are the plain model's) and the embedding, norm and
output layer None where not held. With tied embeddings and the first and last stages on different ranks, both
ranks hold a copy of the weight and their gradients are summed between the two once per step (the engine does
it); on one rank (DualPipeV) it stays one parameter.

What is communicated: activations forward and their gradients backward between neighbouring stages, point to
point on the pp group (`pipeline_comm`), one [micro-batch, local sequence, hidden] tensor per action; the
tied-embedding gradient and the loss and gradient-norm scalars (engine).

The executor (`PipelineExecutor`) does not know what a stage computes: a stage is anything with `forward`,
`backward_input` and `backward_weight` (`PipelineStage`). F receives its input from the previous stage's rank (or
starts from the tokens), runs the stage and sends the output on; B receives the output gradient, backpropagates
and sends the input gradient back; W computes the weight gradients. DualPipeV's fused pairs (`Schedule.fused`,
`layout.pp_fb_overlap`) take both inputs, run the F and the B as two lanes (`lanes.run_pair`: one's collectives
under the other's compute; the B's lane runs its W too where that comes next, `Schedule.unit`, as DualPipe overlaps
a forward with a whole backward) and send both outputs after both have ended. Schedules without a split backward (AFAB,
1F1B, interleaved) run W right after B. For the zero-bubble schedules the split is real: the linear layers of the
blocks become `DeferredGradLinear`, whose backward computes the input gradient and leaves the weight-gradient
matmul (grad_output^T @ input) in a `WeightGradQueue` that the W pass drains; nothing runs twice. The
tensor-parallel linears compose (they stay linears; under sequence parallel the fused q/k/v and gate/up
projections defer their weight gradients too, all-gathering their input in W). The norms, the embedding, the
output layer (whose gradient the fused loss computes in forward) and the MoE experts' batched weights get their
gradients in B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from fivefold import faults
from fivefold.config import Config, ModelConfig
from fivefold.flops import balanced_stage_layers
from fivefold.layout import n_stages
from fivefold.models.llama import Llama, autocast_dtype, build_model, materialize
from fivefold.parallel import lanes
from fivefold.parallel.pipeline_comm import PointToPoint, consumer_stage
from fivefold.parallel.schedules import Action, Schedule

# ---------------------------------------------------------------------------------------------
# The split and its validation


def stage_layer_counts(cfg: Config) -> list[int]:
    """Blocks per global stage, in model order: `layout.stage_layers`, or balanced by compute."""
    if cfg.layout.stage_layers:
        return list(cfg.layout.stage_layers)
    return balanced_stage_layers(cfg.model, n_stages(cfg.layout), cfg.train.seq_len)


def layer_ranges(counts: list[int]) -> list[range]:
    """The global block indices of each stage."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def stage_module(full: Llama, layers: range, first: bool, last: bool) -> Llama:
    """The plain `Llama` holding `full`'s blocks `layers` (shared, not copied), with the embedding on the first
    stage and the final norm and output layer on the last; None elsewhere."""
    with torch.device("meta"):
        stage = Llama(dataclasses.replace(full.cfg, n_layers=0))
    stage.cfg = full.cfg
    stage.embed = full.embed if first else None
    stage.layers = nn.ModuleDict({str(i): full.layers[str(i)] for i in layers})
    stage.norm = full.norm if last else None
    stage.lm_head = full.lm_head if last else None
    return stage


def build_stages(cfg: ModelConfig, counts: list[int], placement: tuple[int, ...], pp_rank: int,
                 device: torch.device, seed: int) -> dict[int, Llama]:
    """This rank's stages {global stage: Llama}: the full model is described on the meta device and only this
    rank's stages are kept; on `device` they are then allocated and initialised from the seed (the values of the
    one-process model, `models.llama.draw_initial_values`). With `device="meta"` they stay descriptions, for the
    engine to shard first (`train.build.build_engine`: `parallelize.apply_model_parallel` on each stage,
    then `parallelize.apply_data_parallel` once)."""
    full = build_model(cfg, device="meta")
    ranges, last = layer_ranges(counts), len(counts) - 1
    stages = {s: stage_module(full, ranges[s], s == 0, s == last) for s, r in enumerate(placement) if r == pp_rank}
    if str(device) != "meta":
        for stage in stages.values():
            materialize(stage, device, seed)
        if cfg.tied_embeddings and 0 in stages and last in stages:
            stages[last].lm_head.weight = stages[0].embed.weight
    return stages


def activation_dtype(stages: list[nn.Module], bf16: bool) -> torch.dtype:
    """The dtype of the hidden states that `stages` produce, and so of what they send: the residual stream starts
    as the embedding's output, in the parameters' dtype, and the blocks add their outputs (computed in bf16 under
    autocast) into it, which keeps the wider of the two."""
    param = next(p for stage in stages for p in stage.parameters())
    if stages[0].cfg.fp32_residual:  # `model.fp32_residual`: the stream stays fp32 whatever the weights
        return torch.float32
    return torch.promote_types(param.dtype, torch.bfloat16) if bf16 else param.dtype


# ---------------------------------------------------------------------------------------------
# The B / W split: linear layers that leave their weight gradient for later


class WeightGradQueue:
    """Weight-gradient work that the B pass of a split schedule leaves for its W pass, per (micro-batch, stage).

    During `collect(key)` (around B's backward) deferred layers add (weight, compute) items; `run(key)` (the W
    pass) computes them and accumulates them into the weights' `.grad` through autograd, so that the gradient
    hooks of data parallel fire as they would in a plain backward."""

    def __init__(self, first_block_only: bool = False) -> None:
        # a whole backward's overlap (`layout.pp_comm_overlap`) needs only enough weight-gradient work after the
        # input gradient to cover its send: the stage's first block's, whose pending W keeps one block's inputs
        # and output gradients instead of the whole stage's (7.6 GB per micro-batch on the 70B example's stage)
        self.first_block_only = first_block_only
        self.pending: dict[tuple[int, int], list[tuple[nn.Parameter, Callable[[], torch.Tensor]]]] = {}
        self._open: list | None = None
        self._immediate = False

    @contextlib.contextmanager
    def immediately(self) -> Iterator[None]:
        """Compute the weight gradients inside B instead of deferring them (ZeRO-3's last backward of a stage, whose
        reduce-scatter must see them: `pipeline_zero3`)."""
        self._immediate = True
        try:
            yield
        finally:
            self._immediate = False

    @contextlib.contextmanager
    def collect(self, key: tuple[int, int]) -> Iterator[None]:
        self._open = self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self._open = None

    def defer(self, weight: nn.Parameter, compute: Callable[[], torch.Tensor]) -> None:
        if self._immediate:  # inside backward already: accumulate as autograd would
            grad = compute().to(weight.dtype)
            weight.grad = grad if weight.grad is None else weight.grad.add_(grad)
            return
        if self._open is None:
            raise RuntimeError("a deferred-gradient layer ran backward outside a pipeline B pass")
        self._open.append((weight, compute))

    def run(self, key: tuple[int, int]) -> None:
        """The W pass of `key`: each weight's gradient computed and accumulated before the next is computed, as a
        plain backward does, so that one weight's gradient at a time exists beside the `.grad` buffers (all of a
        stage's at once would be its whole bf16 weight gradient: 8.9 GiB on the 70B example's first stage)."""
        items = self.pending.pop(key, [])
        items.reverse()
        while items:
            weight, compute = items.pop()  # dropping the closure frees its saved input and output gradient
            with torch.no_grad():  # as inside backward
                grad = compute().to(weight.dtype)
            del compute
            torch.autograd.backward(weight, grad)
            del grad

    def __len__(self) -> int:
        return sum(len(v) for v in self.pending.values())


class _DeferredWeightLinear(torch.autograd.Function):
    """`x @ weight.T` whose backward returns the input gradient and defers the weight gradient. The weight enters
    detached, with the parameter itself passed aside, so that B does not touch the parameter's gradient at all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, param: tuple[nn.Parameter],
                queue: WeightGradQueue) -> torch.Tensor:
        device, dtype = x.device.type, autocast_dtype(x)  # reused in backward, which autocast does not reach
        with torch.autocast(device, enabled=False):
            x = x.to(dtype)
            out = F.linear(x, weight.to(dtype))
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.param, ctx.queue = dtype, param[0], queue
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)

        def weight_grad() -> torch.Tensor:
            return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

        ctx.queue.defer(ctx.param, weight_grad)
        return grad @ weight.to(ctx.dtype), None, None, None


class DeferredGradLinear(nn.Linear):
    """A bias-free linear whose backward computes the input gradient and defers the weight gradient to
    `weight_grad_queue` (see `WeightGradQueue`)."""

    weight_grad_queue: WeightGradQueue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferredWeightLinear.apply(x, self.weight.detach(), (self.weight,), self.weight_grad_queue)


def defer_weight_grads(stage: Llama, queue: WeightGradQueue) -> None:
    """Make the bias-free linear layers of `stage`'s blocks defer their weight gradients to `queue` (after tensor
    parallel, whose modules keep their linears); a linear with a bias (Qwen2's q/k/v) computes its gradients in the
    backward itself. Modules that fuse their input projections (sequence parallel) read `weight_grad_queue` too.
    Under `queue.first_block_only` (a whole backward's overlap) only the stage's first block defers."""
    blocks = list(stage.layers.values())
    for block in blocks[:1] if queue.first_block_only else blocks:
        for module in block.modules():
            if type(module) is nn.Linear:
                if module.bias is not None:
                    continue
                module.__class__ = DeferredGradLinear
            if isinstance(module, DeferredGradLinear) or hasattr(module, "sequence_parallel"):
                module.weight_grad_queue = queue


# ---------------------------------------------------------------------------------------------
# The executor


def pair_backward(stage: PipelineStage, micro_batch: int, grad: torch.Tensor | None,
                  weight: bool) -> torch.Tensor | None:
    """A fused pair's second lane: B's input gradient, then (`weight`) the same micro-batch's W pass."""
    grad_input = stage.backward_input(micro_batch, grad)
    if weight:
        stage.backward_weight(micro_batch)
    return grad_input


class PipelineStage(Protocol):
    """What the executor needs of a stage. `forward` gets the input (None on the first stage, which reads its own
    data) and returns the output to send (None on the last stage); `backward_input` gets the output gradient
    (None on the last stage, which starts from its loss) and returns the input gradient (None on the first);
    `backward_weight` computes the weight gradients of that micro-batch."""

    def forward(self, micro_batch: int, inputs: torch.Tensor | None) -> torch.Tensor | None: ...

    def backward_input(self, micro_batch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None: ...

    def backward_weight(self, micro_batch: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class Ran:
    """One executed action: when its compute began (after its input arrived) and when it ended with its output
    sent (the send and the receives after it posted, before waiting for anything else), in `time.perf_counter`
    seconds. `posted` is the host time of that posting inside [start, end] (on a fused pair's last action)."""

    action: Action
    start: float
    end: float
    posted: float = 0.0


class PipelineExecutor:
    """Runs pp rank `rank`'s action list of a schedule over its stages, with point-to-point transfers of tensors
    of `shape` and `dtype` (the dtype of the activations the stages produce) on `group` (the pp group; ranks are pp
    ranks), one batch per action (`pipeline_comm`). `trace` holds what the last `run` executed, in order."""

    def __init__(self, group: ProcessGroup, rank: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, overlap: bool = False, channels: Sequence[ProcessGroup] = ()) -> None:
        self.group, self.rank, self.shape, self.dtype, self.device = group, rank, shape, dtype, device
        self.channels = channels  # one communicator per edge and direction (`pipeline_comm.edge_channel`), or none
        # `layout.pp_comm_overlap`: a whole backward's input gradient is posted before its weight gradients are
        # computed (the stages defer them, as for a split schedule's W)
        self.overlap = overlap
        self.trace: list[Ran] = []

    def run(self, schedule: Schedule, stages: Mapping[int, PipelineStage]) -> list[Ran]:
        mine = {s for s, r in enumerate(schedule.stage_rank) if r == self.rank}
        if set(stages) != mine:
            raise ValueError(f"pp rank {self.rank} holds stages {sorted(mine)} of schedule {schedule.name}, "
                             f"got stages {sorted(stages)}")
        p2p = PointToPoint(schedule, self.rank, self.group, self.shape, self.dtype, self.device, self.channels)
        last = schedule.n_stages - 1
        local: dict[tuple[str, int, int], torch.Tensor] = {}  # handed between two stages of this rank
        where = schedule.stage_rank
        self.trace = []

        def take(kind: str, mb: int, s: int) -> torch.Tensor | None:
            """The input of action (kind, mb, s): None where it starts from the tokens (F of the first stage) or
            from its loss (B of the last), else the producing stage's tensor, handed over here or received."""
            if (kind, s) in (("F", 0), ("B", last)):
                return None
            key = (kind, mb, s - 1 if kind == "F" else s + 1)
            return local.pop(key) if where[key[2]] == self.rank else p2p.receive(key)

        def give(kind: str, mb: int, s: int, tensor: torch.Tensor | None) -> None:
            """Action (kind, mb, s)'s output to its consumer: kept here or sent (none from F of the last stage or B
            of the first)."""
            if (kind, s) in (("F", last), ("B", 0)):
                return
            if where[consumer_stage(kind, s)] == self.rank:
                local[(kind, mb, s)] = tensor.detach()
            else:
                sent[(kind, mb, s)] = tensor

        def post(index: int, sent: dict[tuple[str, int, int], torch.Tensor]) -> float:
            """Post batch `index` of the plan; its host seconds."""
            begun = time.perf_counter()
            p2p.post(index, sent)
            return time.perf_counter() - begun

        p2p.post(0, {})
        actions = schedule.actions[self.rank]
        fused = schedule.fused_at(self.rank)
        index = 0
        while index < len(actions):
            action = actions[index]
            kind, mb, s = action
            stage = stages[s]
            sent: dict[tuple[str, int, int], torch.Tensor] = {}
            unit = schedule.unit(self.rank, index, fused)
            if len(unit) > 1:  # a fused pair: F and the other chunk's B (and W) as two lanes, then both sends
                b_mb, b_s = unit[1].micro_batch, unit[1].stage
                faults.note(micro_batch=mb, action=f"F of stage {s} with B of micro-batch {b_mb}, stage {b_s}")
                x, grad = take("F", mb, s), take("B", b_mb, b_s)
                start = time.perf_counter()
                second = functools.partial(pair_backward, stages[b_s], b_mb, grad, len(unit) == 3)
                y, grad_input = lanes.run_pair(functools.partial(stage.forward, mb, x), second)
                give("F", mb, s, y)
                give("B", b_mb, b_s, grad_input)
                posted = sum(post(index + k, {}) for k in range(1, len(unit))) + post(index + len(unit), sent)
                end = time.perf_counter()
                self.trace += [Ran(a, start, end, posted if i == len(unit) - 1 else 0.0) for i, a in enumerate(unit)]
                index += len(unit)
                continue
            faults.note(micro_batch=mb, action=f"{kind} of stage {s}")
            posted = None  # seconds of posting, once posted
            if kind == "F":
                x = take("F", mb, s)
                start = time.perf_counter()
                give("F", mb, s, stage.forward(mb, x))
            elif kind == "B":
                grad = take("B", mb, s)
                start = time.perf_counter()
                give("B", mb, s, stage.backward_input(mb, grad))
                if not schedule.split_backward:  # a whole backward: its input gradient leaves when it is done, or
                    if self.overlap:  # (overlap) with the receives that follow it while this rank computes the
                        posted = post(index + 1, sent)  # weight gradients
                    stage.backward_weight(mb)
            else:
                start = time.perf_counter()
                stage.backward_weight(mb)
            if posted is None:
                posted = post(index + 1, sent)  # this action's send with the receives that follow it
            self.trace.append(Ran(action, start, time.perf_counter(), posted))
            index += 1
        p2p.finish()
        if local:
            raise RuntimeError(f"pipeline step ended with local hand-overs unused: {sorted(local)}")
        return self.trace
