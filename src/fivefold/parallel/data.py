"""Data parallel and ZeRO-1/2/3 over the data-parallel ranks of the grid.

What is sharded and what is communicated (Ψ = this tp rank's parameters, N_d = dp, fp32 master weights):

* **ZeRO-0 (plain data parallel).** Every rank holds all parameters (4Ψ bytes), gradients (4Ψ) and Adam
  states (8Ψ). Gradients live in flat buckets (about `layout.dp_bucket_elements` elements each: Megatron's rule
  max(40 M, 1 M x dp x cp) unless `layout.dp_bucket_size` says; parameters in reverse order of definition, so
  roughly the order backward produces them). A bucket's all-reduce is launched
  asynchronously from the gradient hooks as soon as backward has produced its last gradient, while backward
  goes on with the earlier layers; it is skipped on every micro-batch but the last, where gradients only
  accumulate in the bucket.
* **ZeRO-1.** Same buckets, but the last micro-batch reduce-scatters each bucket (Ψ) instead of
  all-reducing it; each rank steps AdamW on its 1/N_d slice only (8Ψ/N_d of states) and then all-gathers the
  updated parameters (Ψ): bucket by bucket in the order the next forward needs them, without waiting
  (`layout.dp_overlap_param_gather`, on by default); each transformer block waits for its own buckets just before
  its forward (the embedding for its own, the final norm for its own and the output layer's, which the loss reads
  directly), so the gathers of later blocks run under the forward of earlier ones. Anything that reads or writes
  the state first waits for them all (`reshard`).
* **ZeRO-2.** As ZeRO-1, but a rank keeps only its gradient slice (4Ψ/N_d): every micro-batch reduce-scatters
  each bucket as soon as it is complete and adds the result into the slice, then frees the bucket (a full
  gradient can only be accumulated where it is kept). At most `ZERO2_IN_FLIGHT` (2) reduce-scatters are in
  flight: launching a third finishes the oldest, so a rank holds at most three full buckets, the one filling
  included, whatever the schedule (before, a pipeline's buckets lived until the step's end: the 70B example's
  first stage held its whole fp32 gradient, 19 GB, beside the slice).
* **ZeRO-3.** Parameters are sharded too (all /N_d), through PyTorch's `fully_shard` (FSDP2) with one unit per
  transformer block plus a root unit (embedding, final norm, output layer): each block's weights are
  all-gathered just before its forward (the next block's gather is prefetched), freed after it, gathered again
  for its backward and their gradients reduce-scattered every micro-batch. Under expert parallel the routed
  experts of each MoE layer are a unit of their own over the ranks that hold the same experts (edp = N_d / ep):
  a rank keeps dense/N_d + its ep shard of the experts/edp (`FullyShardedDataParallel`).

Gradients are summed, not averaged: the loss is already divided by the global batch's token count (see
`fivefold.train.engine`). With `fp32_grad_accum` (the default) the buckets hold fp32 gradients whatever the
parameter dtype.

**Lean mixed precision (`param_dtype=torch.bfloat16`, the distributed optimizer).** The flat buckets, hence the
model's parameters, hold bf16 working weights (2Ψ); the gradient buckets hold fp32 (4Ψ, `fp32_grad_accum`, the
default) or bf16 (2Ψ) gradients, accumulated over the micro-batches and reduced in that dtype; AdamW steps an fp32
master copy of this rank's slice only (4Ψ/N_d under ZeRO-1/2, the whole flat under ZeRO-0) with its moments
(8Ψ/N_d): 2 + (4 or 2) + 12/N_d bytes per parameter under ZeRO-1, Megatron's distributed optimizer.
After the step the master slice is cast to bf16 once and all-gathered (Ψ bf16), so the working weights are cast
once per optimizer step, not per micro-batch. ZeRO-3 uses `fully_shard`'s `MixedPrecisionPolicy` instead (bf16
all-gathers of the sharded fp32 parameters, fp32 reduce-scatters into the fp32 gradient shards, and under a
pipeline, which reduces once per step, fp32 accumulation of the unsharded gradients), whatever `fp32_grad_accum`
says.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from fivefold.parallel.tensor_comm import all_gather_into, reduce_scatter_into

# ZeRO-2's reduce-scatters in flight before the oldest is finished and its full bucket freed
ZERO2_IN_FLIGHT = 2

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fivefold.parallel.mesh import Zero3Meshes



@dataclass
class Segment:
    """Elements of one plain-model parameter that this rank holds, and where AdamW keeps their moments: the flat
    range [start, end) (row-major) of this rank's local tensor, a rectangle of the global tensor at `offsets`
    (its tp slice, ep experts or ZeRO-3 shard; the whole tensor on one device)."""

    name: str
    shape: tuple[int, ...]  # of the global tensor
    offsets: tuple[int, ...]  # of the local tensor in it
    local_shape: tuple[int, ...]
    start: int
    end: int
    weight: torch.Tensor  # 1-D view of the (fp32 master) weights of those elements
    opt_param: torch.Tensor  # the parameter whose AdamW state holds their moments
    opt_start: int  # at this offset of its flattened state
    write: bool  # this rank writes them (one owner per element: the first of the replicas)


# (plain name, local shape) -> (global shape, offsets of this rank's tp/ep part in it, first tp replica or not)
Placement = Callable[[str, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...], bool]]


class DataParallel(Protocol):
    """What the engine asks of data parallel, whatever implements it: `LocalDataParallel` (one device),
    `BucketedDataParallel` (ZeRO-0/1/2 buckets), `FullyShardedDataParallel` (ZeRO-3 and HSDP through
    `fully_shard`) and `pipeline_zero3.PipelineFullyShardedDataParallel` (`fully_shard` per pipeline stage). Lean
    mixed precision (bf16 working weights, fp32 masters that AdamW steps) lives behind it."""

    sync: bool  # synchronise: reduce the gradients on this micro-batch (the last of the accumulation)
    # whether `end_micro_batch` waits for a reduction of this micro-batch (where a rank meets its peers)
    reduces_now: bool

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward (a pipeline: after the step's schedule): finish the reductions."""

    def expect_accumulations(self, per_param: Callable[[nn.Parameter], int]) -> None:
        """Gradient accumulations of each parameter that complete a pipeline step."""

    def sum_tied_grads(self) -> None:
        """Sum the reduced gradients of a tied weight's two copies (pipeline), after the step's backward."""

    def attach_grads(self) -> None:
        """Point what the optimizer steps at the reduced gradients (fp32 under lean mixed precision)."""

    def grad_square_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tp-sharded, tp-replicated) sums of squared gradients held here, summed over this data-parallel group."""

    def optimizer_params(self) -> list[nn.Parameter]:
        """What AdamW steps on this rank."""

    def after_step(self) -> None:
        """After the optimizer step, before the gradients are cleared (cast or gather the working weights)."""

    def reshard(self) -> None:
        """Free the weights a forward left gathered (before the state is read or written)."""

    def plain_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tp/ep-local state with its values in full: fp32 masters, whole `fully_shard` tensors."""

    def after_load(self) -> None:
        """After a checkpoint's pieces were loaded into the segments: make the working weights agree."""

    def state_segments(self, named: list[tuple[str, nn.Parameter]], place: Placement) -> list[Segment]:
        """Every element of the training state this rank holds here, by plain parameter name (`Segment`)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters and gradient buffers kept between steps."""

    def master_bytes(self) -> int:
        """Bytes of the fp32 master weights under lean mixed precision (0 otherwise)."""


class LocalDataParallel:
    """Data parallel over one device: nothing to reduce. With `lean` (bf16, the default on accelerators) the model
    holds bf16 working weights, so activations and the residual stream are bf16 and no weight is cast per
    micro-batch; its gradients are added into fp32 buffers as backward produces them (`fp32_grad_accum`, the
    default), or accumulate in bf16 over the micro-batches; AdamW steps an fp32 master copy of every parameter,
    which is cast to the working weights once after each step. State: 2 + (4 or 2) + 12 bytes per parameter
    (weights, gradients, master and moments), where autocast over fp32 weights holds 4 + 4 + 8 plus a bf16 copy of
    every weight per micro-batch in flight. The master copy is the model state that checkpoints save and load.

    It is not `BucketedDataParallel` over a group of one: flat buckets keep a gradient buffer between steps and sum
    the gradient norm bucket by bucket, which would change one device's peak memory and the last bits of its
    clipping."""

    def __init__(self, model: nn.Module, lean: bool, fp32_grad_accum: bool = False) -> None:
        self.model, self.sync = model, True
        self.names: list[str] = []
        self.working: list[nn.Parameter] = []
        masters = []
        if lean:
            for name, p in model.named_parameters():  # a tied weight once
                masters.append(nn.Parameter(p.detach().clone()))
                p.data = p.data.to(torch.bfloat16)
                self.names.append(name)
                self.working.append(p)
        self.master = nn.ParameterList(masters) if lean else None
        ids = {id(p): i for i, p in enumerate(self.working)}
        self.aliases = {name: ids[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}
        if lean and fp32_grad_accum:
            for p, m in zip(self.working, self.master, strict=True):
                p.register_post_accumulate_grad_hook(self._accumulate_into(m))

    @staticmethod
    def _accumulate_into(master: nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None
        return hook

    reduces_now = False  # one device

    def end_micro_batch(self) -> None:
        """Gradients accumulate in place."""

    def expect_accumulations(self, per_param: Callable[[nn.Parameter], int]) -> None:
        """No reductions to time."""

    def sum_tied_grads(self) -> None:
        """A tied weight is one parameter here."""

    def attach_grads(self) -> None:
        """Lean: the bf16 gradients to the fp32 masters, one tensor at a time."""
        for p, m in zip(self.working, self.master or [], strict=True):
            if p.grad is not None:
                m.grad = p.grad.float()
                p.grad = None

    def grad_square_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(0, sum of squares): nothing is tp-sharded. The one-device engine clips with torch's total norm
        instead (`Engine.grad_norm`), whose summation order this does not keep."""
        params = self.optimizer_params()
        sums = torch.zeros(2, dtype=torch.float32, device=params[0].device)
        for p in params:
            if p.grad is not None:
                sums[1] += p.grad.float().pow(2).sum()
        return sums[0], sums[1]

    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.master) if self.master is not None else list(self.model.parameters())

    @torch.no_grad()
    def after_step(self) -> None:
        """The working weights from the fp32 masters (once per optimizer step, and after a load)."""
        for p, m in zip(self.working, self.master or [], strict=True):
            p.copy_(m)

    def reshard(self) -> None:
        """Nothing is sharded."""

    def plain_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.master is None:
            return state
        return {name: (self.master[self.aliases[name]].detach() if name in self.aliases else t)
                for name, t in state.items()}

    def after_load(self) -> None:
        self.after_step()

    def state_segments(self, named: list[tuple[str, nn.Parameter]], place: Placement) -> list[Segment]:
        """Every parameter whole (the fp32 master under lean mixed precision)."""
        if self.master is not None:
            named = list(zip(self.names, self.master, strict=True))
        return [Segment(name, tuple(p.shape), (0,) * p.ndim, tuple(p.shape), 0, p.numel(), p.detach().view(-1), p,
                        0, True) for name, p in named]

    def state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {"parameters": sum(p.numel() * p.element_size() for p in params),
                "gradients": sum(t.grad.numel() * t.grad.element_size() for t in [*params, *(self.master or [])]
                                 if t.grad is not None)}

    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.master or [])


@dataclass(eq=False)  # a bucket is itself, compared by identity (`in_flight`)
class Bucket:
    """A flat group of parameters with one gradient buffer. Parameters are views into `flat_params`."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # padded to a multiple of dp
    flat_params: torch.Tensor
    grad_dtype: torch.dtype
    decay: bool
    tp_sharded: bool
    shard: nn.Parameter | None = None  # ZeRO-1/2: this rank's slice of flat_params, stepped by AdamW
    grad: torch.Tensor | None = None  # full flat gradient (ZeRO-0/1 always; ZeRO-2 during one micro-batch)
    shard_grad: torch.Tensor | None = None  # ZeRO-2: this rank's accumulated gradient slice
    ready: int = 0  # gradient accumulations since the last reduction
    expected: int = 0  # accumulations that complete the bucket: one per parameter, or per pipeline step
    count_in_norm: bool = True  # False for a copy whose gradient another rank also counts (tied embeddings)
    launched: bool = False
    work: list = field(default_factory=list)  # (async handle, output to fold into shard_grad or None)
    master_source: torch.Tensor | None = None  # lean mixed precision: the fp32 values until the master is cut
    names: list[str] = field(default_factory=list)  # the parameters' plain names

    def grad_view(self, index: int) -> torch.Tensor:
        p = self.params[index]
        return self.grad[self.offsets[index]:self.offsets[index] + p.numel()].view_as(p)


def make_buckets(named_params: list[tuple[str, nn.Parameter]], tp_sharded: set[str], dp_size: int,
                 bucket_elements: int, fp32_grad_accum: bool, own_bucket: frozenset[str] = frozenset(),
                 param_dtype: torch.dtype | None = None) -> list[Bucket]:
    """Flat buckets of parameters that share a weight-decay class, a tp-sharding class and a dtype (so that
    one slice of a bucket is one optimizer group, and the gradient norm can tell sharded from replicated).
    Parameters named in `own_bucket` get a bucket each (a tied weight whose gradient is summed with another
    rank's). The parameters become views into their bucket's flat storage, in `param_dtype` when given (their
    values before the cast stay in `Bucket.master_source` for the master copy)."""
    classes: dict[tuple, list[list[tuple[str, nn.Parameter]]]] = {}
    sizes: dict[tuple, int] = {}
    for name, p in reversed(named_params):
        key = (p.ndim >= 2, name in tp_sharded, p.dtype, name if name in own_bucket else "")
        lists = classes.setdefault(key, [[]])
        if lists[-1] and sizes[key] + p.numel() > bucket_elements:
            lists.append([])
            sizes[key] = 0
        lists[-1].append((name, p))
        sizes[key] = sizes.get(key, 0) + p.numel()
    buckets = []
    for (decay, sharded, dtype, _), lists in classes.items():
        for members in lists:
            offsets, total = [], 0
            for _, p in members:
                offsets.append(total)
                total += p.numel()
            numel = -(-total // dp_size) * dp_size
            flat = torch.zeros(numel, dtype=dtype, device=members[0][1].device)
            params = [p for _, p in members]
            for p, off in zip(params, offsets, strict=True):
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            source = None
            if param_dtype is not None and param_dtype != dtype:
                source, flat = flat, flat.to(param_dtype)
            for p, off in zip(params, offsets, strict=True):
                p.data = flat[off:off + p.numel()].view_as(p)
            buckets.append(Bucket(params, offsets, numel, flat, torch.float32 if fp32_grad_accum else flat.dtype,
                                  decay, sharded, expected=len(params), master_source=source,
                                  names=[name for name, _ in members]))
    return buckets


class BucketedDataParallel:
    """ZeRO-0/1/2 over `group` for the parameters of `named_params` (see the module docstring)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], tp_sharded: set[str], group: ProcessGroup,
                 zero: int, bucket_elements: int = 40_000_000, fp32_grad_accum: bool = True,
                 own_bucket: frozenset[str] = frozenset(), param_dtype: torch.dtype | None = None,
                 overlap_param_gather: bool = False) -> None:
        self.group, self.zero = group, zero
        self.dp_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.buckets = make_buckets(named_params, tp_sharded, self.dp_size, bucket_elements, fp32_grad_accum,
                                    own_bucket, param_dtype)
        # ZeRO-1/2's parameter all-gathers in flight after the step: bucket index -> handle; `waits_before`
        # registers who waits for which (until then, and without overlap, the step waits for them)
        self.overlap_param_gather = overlap_param_gather and self.dp_size > 1  # (experts' edp may be 1)
        self.gathers: dict[int, dist.Work] = {}
        self.unwaited: set[int] = set(range(len(self.buckets)))  # buckets no forward hook waits for
        self.gathers_waited_in_forward = 0  # gathers still in flight when a forward hook needed them (overlapped)
        # lean mixed precision: AdamW steps an fp32 master copy of this rank's slice, not the working weights
        self.master = any(b.master_source is not None for b in self.buckets)
        self.sync = True  # reduce on this micro-batch (the last of the accumulation)
        self.tied_buckets: list[Bucket] = []  # a tied weight's copy on this rank (pipeline), summed over tied_group
        self.tied_group: ProcessGroup | None = None
        self.launched_in_backward = 0  # buckets whose reduction started from a gradient hook (overlap)
        # ZeRO-2: the full buckets whose reduce-scatter is in flight, oldest first. Launching one more than
        # `ZERO2_IN_FLIGHT` finishes (and frees) the oldest, so a rank never holds more than that many full buckets
        # beside the one filling, also in a pipeline, whose step ends its micro-batches only at its end
        self.in_flight: collections.deque[Bucket] = collections.deque()
        for bucket in self.buckets:
            if zero == 0 or zero == 1:
                bucket.grad = torch.zeros(bucket.numel, dtype=bucket.grad_dtype, device=bucket.flat_params.device)
            if zero >= 1 or self.master:
                lo, hi = self.shard_range(bucket)
                view = bucket.flat_params[lo:hi]
                if self.master:  # a copy of its own in fp32, from the values before the bf16 cast
                    view = bucket.master_source[lo:hi].clone()
                    bucket.master_source = None
                # the shape carries the weight-decay class to `param_groups` (decay on ndim >= 2)
                bucket.shard = nn.Parameter(view.view(1, -1) if bucket.decay else view)
            if zero == 2:
                bucket.shard_grad = torch.zeros(bucket.numel // self.dp_size, dtype=bucket.grad_dtype,
                                                device=bucket.flat_params.device)
            for index, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._hook(bucket, index))

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        if self.zero == 0:  # the master copy of ZeRO-0 is the whole bucket
            return 0, bucket.numel
        size = bucket.numel // self.dp_size
        return self.dp_rank * size, (self.dp_rank + 1) * size

    def optimizer_params(self) -> list[nn.Parameter]:
        """What AdamW steps: the model's parameters (ZeRO-0) or this rank's slices (ZeRO-1/2); under lean mixed
        precision the fp32 master copy of those."""
        if self.zero == 0 and not self.master:
            return [p for b in self.buckets for p in b.params]
        return [b.shard for b in self.buckets]

    def expect_accumulations(self, per_param: Callable[[nn.Parameter], int]) -> None:
        """For a pipeline, whose micro-batches' backward passes interleave: a ZeRO-0/1 bucket is complete (and its
        reduction starts from the hook) after `per_param(p)` accumulations of each of its parameters; ZeRO-2
        reduce-scatters whenever a bucket has received as many accumulations as it has parameters."""
        for bucket in self.buckets:
            bucket.expected = sum(per_param(p) for p in bucket.params) if self.zero < 2 else len(bucket.params)

    def _hook(self, bucket: Bucket, index: int):
        def hook(p: torch.Tensor) -> None:
            if bucket.launched and self.zero == 2:  # a pipeline's next round while the last one is reduced
                self._finish(bucket)
            if bucket.grad is None:  # ZeRO-2: the full bucket exists only while one micro-batch fills it
                bucket.grad = torch.zeros(bucket.numel, dtype=bucket.grad_dtype, device=p.device)
            bucket.grad_view(index).add_(p.grad)
            p.grad = None
            bucket.ready += 1
            if bucket.ready == bucket.expected and self.reduces_now:
                self._launch(bucket)
                self.launched_in_backward += 1
        return hook

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        if self.zero == 0:
            bucket.work.append((dist.all_reduce(bucket.grad, group=self.group, async_op=True), None))
            return
        lo, hi = self.shard_range(bucket)
        out = torch.empty(hi - lo, dtype=bucket.grad_dtype, device=bucket.grad.device)
        bucket.work.append((reduce_scatter_into(out, bucket.grad, group=self.group, async_op=True), out))
        if self.zero == 2:
            self.in_flight.append(bucket)
            while len(self.in_flight) > ZERO2_IN_FLIGHT:
                self._finish(self.in_flight[0])

    @property
    def reduces_now(self) -> bool:
        """The last micro-batch of the accumulation reduces; under ZeRO-2 every one reduce-scatters."""
        return self.sync or self.zero == 2

    def end_micro_batch(self) -> None:
        """After one micro-batch's backward: reduce what the hooks did not (unused parameters), wait, and for
        ZeRO-2 fold the reduced slice into the kept gradient slice and free the full bucket."""
        if not self.reduces_now:
            for bucket in self.buckets:
                bucket.ready = 0
            return
        for bucket in self.buckets:
            if not bucket.launched:
                if bucket.grad is None:
                    bucket.grad = torch.zeros(bucket.numel, dtype=bucket.grad_dtype, device=bucket.flat_params.device)
                self._launch(bucket)
        for bucket in self.buckets:
            self._finish(bucket)

    def _finish(self, bucket: Bucket) -> None:
        """Wait for the bucket's reductions and keep the result (ZeRO-2: add it to the slice, free the bucket)."""
        for work, out in bucket.work:
            work.wait()
            if out is None:
                continue
            if self.zero == 2:
                bucket.shard_grad.add_(out)
            else:
                lo, hi = self.shard_range(bucket)
                bucket.grad[lo:hi].copy_(out)
        bucket.work.clear()
        bucket.ready, bucket.launched = 0, False
        if self.zero == 2:
            bucket.grad = None
            if bucket in self.in_flight:
                self.in_flight.remove(bucket)

    def reduced_grad(self, bucket: Bucket) -> torch.Tensor:
        """The part of the bucket's reduced gradient this rank keeps (after `end_micro_batch` of the step)."""
        if self.zero == 0:
            return bucket.grad
        if self.zero == 1:
            lo, hi = self.shard_range(bucket)
            return bucket.grad[lo:hi]
        return bucket.shard_grad

    def attach_grads(self) -> None:
        """Point what AdamW steps at the reduced gradients (views, cast if the buffer is fp32)."""
        for bucket in self.buckets:
            if self.zero == 0 and not self.master:
                for index, p in enumerate(bucket.params):
                    p.grad = bucket.grad_view(index).to(p.dtype)
                continue
            bucket.shard.grad = self.reduced_grad(bucket).to(bucket.shard.dtype).view_as(bucket.shard)

    def after_step(self) -> None:
        """ZeRO-1/2: all-gather the updated slices into every rank's full parameters (cast once to the working
        dtype under lean mixed precision), in the order the next forward needs them (the last buckets hold the
        first layers) and, with `overlap_param_gather`, without waiting (`waits_before`); zero the gradients."""
        self.wait_param_gathers()
        for index in reversed(range(len(self.buckets))):
            bucket = self.buckets[index]
            if self.zero >= 1:
                # in place: this rank's slice of the flat parameters is the gather's input (the updated values
                # themselves, or under lean mixed precision their cast from the master, written into it once)
                lo, hi = self.shard_range(bucket)
                own = bucket.flat_params[lo:hi]  # without a master, the shard AdamW stepped is this view itself
                if self.master:
                    own.copy_(bucket.shard.detach().reshape(-1))
                if self.overlap_param_gather:
                    self.gathers[index] = all_gather_into(bucket.flat_params, own, group=self.group, async_op=True)
                else:
                    all_gather_into(bucket.flat_params, own, group=self.group)
                bucket.shard.grad = None
            elif self.master:
                bucket.flat_params.copy_(bucket.shard.detach().reshape(-1))
                bucket.shard.grad = None
            else:
                for p in bucket.params:
                    p.grad = None
            for buf in (bucket.grad, bucket.shard_grad):
                if buf is not None:
                    buf.zero_()
        self.wait_param_gathers(self.unwaited)  # buckets whose parameters no forward hook covers

    def _waiter(self, indices: list[int]):
        def hook(_module: nn.Module, _args: tuple) -> None:
            self.gathers_waited_in_forward += self.wait_param_gathers(indices)
        return hook

    def wait_param_gathers(self, indices: Iterable[int] | None = None) -> int:
        """Wait for the parameter all-gathers in flight of the buckets `indices` (default: all); how many were."""
        if not self.gathers:  # every micro-batch's forward but the step's first, and every step without overlap
            return 0
        waited = 0
        for index in list(self.gathers) if indices is None else indices:
            pending = self.gathers.pop(index, None)
            if pending is not None:
                pending.wait()
                waited += 1
        return waited

    def waits_before(self, parts: Iterable[nn.Module]) -> None:
        """Let the next forward overlap ZeRO-1/2's parameter all-gathers: a forward pre-hook on each unit of the
        model parts waits for the buckets of its parameters, the unit being a parameter's transformer block
        (`layers.N`), the embedding, or the final norm for itself and the output layer (whose weight the loss
        reads directly, after the norm). The buckets of any other parameter are waited for at the end of the
        step. No effect without `overlap_param_gather`."""
        if not self.overlap_param_gather:
            return
        bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket.params}
        units: dict[nn.Module, set[int]] = {}
        covered: set[int] = set()
        for part in parts:
            for name, p in part.named_parameters():
                if id(p) not in bucket_of:
                    continue
                head, _, rest = name.partition(".")
                unit = part.layers[rest.partition(".")[0]] if head == "layers" else \
                    {"embed": part.embed, "norm": part.norm, "lm_head": part.norm}.get(head)
                if unit is not None:
                    units.setdefault(unit, set()).add(bucket_of[id(p)])
                    covered.add(bucket_of[id(p)])
        for unit, indices in units.items():
            unit.register_forward_pre_hook(self._waiter(sorted(indices)))
        self.unwaited = set(range(len(self.buckets))) - covered

    def grad_square_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of squares of tp-sharded gradients, of tp-replicated ones) that this rank holds; under ZeRO the
        slices are disjoint over dp and are summed over the group here."""
        device = self.buckets[0].flat_params.device
        sums = torch.zeros(2, dtype=torch.float32, device=device)
        for bucket in self.buckets:
            if not bucket.count_in_norm:
                continue
            if self.zero == 0:
                g = bucket.grad
            else:
                g = bucket.shard.grad
            sums[0 if bucket.tp_sharded else 1] += g.float().pow(2).sum()
        if self.zero >= 1:
            dist.all_reduce(sums, group=self.group)
        return sums[0], sums[1]

    @torch.no_grad()
    def full_master_state(self) -> dict[str, torch.Tensor]:
        """{plain name: this rank's whole (tp/ep-local) parameter in fp32} from the master slices, all-gathered over
        the group (collective); empty without master weights."""
        if not self.master:
            return {}
        out = {}
        for bucket in self.buckets:
            flat = bucket.shard.detach().reshape(-1)
            if self.zero >= 1:
                full = torch.empty(bucket.numel, dtype=flat.dtype, device=flat.device)
                all_gather_into(full, flat.clone(), group=self.group)
                flat = full
            for name, p, off in zip(bucket.names, bucket.params, bucket.offsets, strict=True):
                out[name] = flat[off:off + p.numel()].view(p.shape).clone()
        return out

    def master_bytes(self) -> int:
        """Bytes of the fp32 master slices that AdamW steps under lean mixed precision (0 otherwise)."""
        if not self.master:
            return 0
        return sum(b.shard.numel() * b.shard.element_size() for b in self.buckets)

    def tie(self, names: frozenset[str], group: ProcessGroup, counted: bool) -> None:
        """The buckets of `names` (a tied weight's copy, each in a bucket of its own) hold gradients that are summed
        with the other copy's over `group` after the step's backward; `counted`: this copy counts in the norm."""
        self.tied_buckets = [b for b in self.buckets if any(n in names for n in b.names)]
        self.tied_group = group
        for bucket in self.tied_buckets:
            bucket.count_in_norm = counted

    def sum_tied_grads(self) -> None:
        """The embedding's and the output layer's gradients are one gradient: sum the two copies'."""
        for bucket in self.tied_buckets:
            dist.all_reduce(self.reduced_grad(bucket), group=self.tied_group)

    def reshard(self) -> None:
        """Buckets hold every parameter whole: wait for the parameter all-gathers still in flight."""
        self.wait_param_gathers()

    def plain_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under lean mixed precision the fp32 master values (all-gathered over the group: collective)."""
        master = self.full_master_state()
        return {**state, **{name: t for name, t in master.items() if name in state}}

    def after_load(self) -> None:
        """ZeRO-1/2: each rank loaded its slice of the flat weights; all-gather the rest as after a step. Under lean
        mixed precision the loaded values are the fp32 masters: cast them to the working weights likewise."""
        if self.zero in (1, 2) or self.master:
            self.after_step()

    def state_segments(self, named: list[tuple[str, nn.Parameter]], place: Placement) -> list[Segment]:
        """The bucket's parameters as this rank's ZeRO stage holds them: whole (ZeRO-0, written by the first rank of
        the group) or the flat slices of each bucket (ZeRO-1/2, and the fp32 masters of lean mixed precision)."""
        names = {id(p): n for n, p in named}
        segments = []
        for bucket in self.buckets:
            lo, hi = self.shard_range(bucket)
            for p, off in zip(bucket.params, bucket.offsets, strict=True):
                name = names[id(p)]
                shape, offsets, first = place(name, tuple(p.shape))
                if self.zero == 0 and not self.master:
                    segments.append(Segment(name, shape, offsets, tuple(p.shape), 0, p.numel(),
                                            p.detach().view(-1), p, 0, first and self.dp_rank == 0))
                    continue
                a, b = max(lo, off) - off, min(hi, off + p.numel()) - off
                if a < b:
                    weight = (bucket.shard.detach().view(-1)[off + a - lo:off + b - lo] if self.master
                              else bucket.flat_params[off + a:off + b])
                    segments.append(Segment(name, shape, offsets, tuple(p.shape), a, b, weight, bucket.shard,
                                            off + a - lo, first and (self.zero >= 1 or self.dp_rank == 0)))
        return segments

    def state_bytes(self) -> dict[str, int]:
        """Bytes of parameters and gradient buffers this rank keeps between steps (padding included)."""
        params = sum(b.flat_params.numel() * b.flat_params.element_size() for b in self.buckets)
        grads = 0
        for b in self.buckets:
            kept = b.grad if self.zero < 2 else b.shard_grad
            grads += kept.numel() * kept.element_size()
        return {"parameters": params, "gradients": grads}


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The local part of a `fully_shard` DTensor; a plain tensor (a parameter no unit shards) as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a `fully_shard` DTensor (collective over its mesh); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def dim0_shard(t: torch.Tensor) -> tuple[int, int]:
    """(this rank's chunk index, chunks) of `t`'s dim 0 as `fully_shard` splits it over its own mesh (dp x cp, or
    edp for routed experts; under HSDP the mesh's shard dimension), the way `torch.chunk` does; (0, 1) for a plain
    tensor (held whole)."""
    if not hasattr(t, "device_mesh"):
        return 0, 1
    mesh = t.device_mesh
    dim = next(i for i, p in enumerate(t.placements) if p.is_shard()) if mesh.ndim > 1 else 0
    return mesh.get_local_rank(dim), mesh.size(dim)


def hsdp_replica(t: torch.Tensor) -> int:
    """This rank's replica index of an HSDP shard (the mesh's replicate dimension); 0 without HSDP."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None or mesh.ndim == 1:
        return 0
    return mesh.get_local_rank(next(i for i, p in enumerate(t.placements) if p.is_replicate()))


def shard_square_sums(grads: Iterable[tuple[bool, torch.Tensor]], group: ProcessGroup,
                      replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(tp-sharded, tp-replicated) sums of squares of ZeRO-3's gradients (`grads`: (tp-sharded, gradient) pairs,
    `fully_shard` DTensors or plain tensors) over `group` (dp x cp). Each element counts once: the dense shards are
    disjoint over dp x cp, and so are the expert shards (dp x cp is ep groups times edp groups; each rank holds its
    ep rank's experts, cut over edp, or whole with edp = 1). Under HSDP every shard is held by each of the
    `replicas`, so the sum is divided by them."""
    sums = torch.zeros(2, dtype=torch.float32)
    for tp_sharded, grad in grads:
        g = local_part(grad)
        sums = sums.to(g.device)
        sums[0 if tp_sharded else 1] += g.float().pow(2).sum()
    dist.all_reduce(sums, group=group)
    if replicas > 1:
        sums /= replicas
    return sums[0], sums[1]


def shard_state_bytes(params: Iterable[nn.Parameter]) -> dict[str, int]:
    """Bytes of the local parts of `params` and of their gradients (what this rank holds under ZeRO-3)."""
    held = grads = 0
    for p in params:
        local = local_part(p)
        held += local.numel() * local.element_size()
        if p.grad is not None:
            grads += local_part(p.grad).numel() * local.element_size()
    return {"parameters": held, "gradients": grads}


def shard_units(blocks: Iterable[nn.Module], root: nn.Module, meshes: Zero3Meshes, param_dtype: torch.dtype | None,
                reshard_after_forward: bool = True) -> list[nn.Module]:
    """ZeRO-3's `fully_shard` units over `meshes.dense` (dp x cp; under HSDP a 2D replicate x shard mesh, over whose
    replicate dimension fully_shard all-reduces each reduced shard): one per transformer block and one for `root`
    (the rest), each block's gather prefetched by the one before it, with lean mixed precision where `param_dtype`
    is set (the fp32 shards gathered in it, gradients reduce-scattered in fp32). Units are built innermost first (a
    unit manages the parameters no unit inside it holds). Under expert parallel the routed experts' weights of an
    MoE block shard over `meshes.experts` (the ranks that hold the same experts): the router and the shared
    experts become small units over the dense mesh, the MoE module a unit over the experts' mesh holding only
    `w_gate`, `w_up`, `w_down`; without an experts' mesh (edp = 1) those three stay plain tensors, ignored by the
    block's and the root's units. Returns every unit (the units inside the blocks, the blocks', the root's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fivefold.models.llama import MoE

    mesh, experts_mesh = meshes.dense, meshes.experts
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)

    def unit(module: nn.Module, on: DeviceMesh, ignored: set[nn.Parameter] | None = None) -> nn.Module:
        return fully_shard(module, mesh=on, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                           ignored_params=ignored or None)

    inner: list[nn.Module] = []
    block_units: list[nn.Module] = []
    plain: set[nn.Parameter] = set()
    for block in blocks:
        whole: set[nn.Parameter] = set()
        moe = block.mlp if meshes.expert_parallel and isinstance(block.mlp, MoE) else None
        if moe is not None:
            inner += [unit(m, mesh) for m in (moe.router, moe.shared) if m is not None]
            if experts_mesh is not None:
                inner.append(unit(moe, experts_mesh))
                # MoE returns a view of its output; the block adds it out of place, which keeps the unit's
                # pre-backward hook, so fully_shard's warning about in-place ops on it does not apply
                warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoE\) returned a view",
                                        category=UserWarning)
            else:
                whole = {moe.w_gate, moe.w_up, moe.w_down}
                plain |= whole
        block_units.append(unit(block, mesh, whole))
    units = [*inner, *block_units, unit(root, mesh, plain)]
    for u in units:
        u.set_gradient_divide_factor(1.0)  # the loss is already normalised over the global batch
        u.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied sum)
    for before, after in zip(block_units[:-1], block_units[1:], strict=True):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    return units


class ShardedState:
    """The checkpoint side of `DataParallel` for `fully_shard` (ZeRO-3, HSDP, and per pipeline stage): the shards
    are the fp32 weights, each rank reads and writes its own."""

    def master_bytes(self) -> int:
        """No separate master copy (`fully_shard` gathers the fp32 shards in bf16)."""
        return 0

    def plain_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole tensors (collective over each parameter's mesh); experts whole over edp are plain."""
        return {name: full_value(t) for name, t in state.items()}

    def after_load(self) -> None:
        """Each rank loaded its own shards."""

    def state_segments(self, named: list[tuple[str, nn.Parameter]], place: Placement) -> list[Segment]:
        return shard_segments(named, place)


class FullyShardedDataParallel(ShardedState):
    """ZeRO-3 through `fully_shard`: one unit per transformer block and a root unit for the rest (see the
    module docstring). `root` must be the module whose forward computes the loss, so that the root unit's
    hooks run around the whole micro-batch.

    Under expert parallel (the ranks holding the same experts, edp = dp x cp / ep of them) the
    routed experts' weights of each MoE layer shard over that group instead: the MoE module becomes a unit of
    its own over the edp mesh, holding only `w_gate`, `w_up`, `w_down` (its router and shared experts are
    small units over the dp x cp mesh, so that they shard and reduce with the dense weights), inside its
    block's unit over dp x cp. With edp = 1 every rank holds other experts: there is nothing to shard or
    reduce, and the expert weights stay plain tensors, ignored by the units (like expert parallel without
    data parallel)."""

    def __init__(self, root: nn.Module, model: nn.Module, tp_sharded: set[str], group: ProcessGroup,
                 meshes: Zero3Meshes, param_dtype: torch.dtype | None = None) -> None:
        self.group, self.zero, self.sync = group, 3, True
        self.tp_sharded, self.replicas = tp_sharded, meshes.replicas
        shard_units(model.layers.values(), root, meshes, param_dtype)
        self.root, self.model = root, model

    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.root.parameters())

    reduces_now = False  # fully_shard waits for its reduce-scatters inside the backward

    def end_micro_batch(self) -> None:
        """fully_shard has reduce-scattered every block's gradients by the end of backward."""

    def attach_grads(self) -> None:
        """The reduced gradient shards are already the parameters' `.grad`."""

    def after_step(self) -> None:
        """Parameters stay sharded; the next forward gathers them."""

    def grad_square_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tp-sharded, tp-replicated) sums of squares over the dp x cp group (`shard_square_sums`)."""
        grads = ((name in self.tp_sharded, p.grad) for name, p in self.model.named_parameters() if p.grad is not None)
        return shard_square_sums(grads, self.group, self.replicas)

    def state_bytes(self) -> dict[str, int]:
        return shard_state_bytes(self.root.parameters())

    def expect_accumulations(self, per_param: Callable[[nn.Parameter], int]) -> None:
        """No buckets to count gradient arrivals for."""

    def sum_tied_grads(self) -> None:
        """A tied weight is one parameter here."""

    def reshard(self) -> None:
        """Free what a forward left gathered (an evaluation forward leaves the root unsharded)."""
        reshard_units(self.root)


def reshard_units(root: nn.Module) -> None:
    """Reshard every `fully_shard` unit under `root`."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def shard_segments(named: list[tuple[str, nn.Parameter]], place: Placement) -> list[Segment]:
    """ZeRO-3's segments: each parameter's dim-0 shard of its tp/ep part (`fully_shard` splits dim 0 over its mesh as
    `torch.chunk` does); under HSDP each replica holds the same shard and the first replica writes it."""
    segments = []
    for name, p in named:
        shape, offsets, first = place(name, tuple(p.shape))
        local = local_part(p)  # experts whole over edp = 1 are plain tensors
        index, chunks = dim0_shard(p)
        rows = -(-p.shape[0] // chunks)
        offsets = (offsets[0] + min(index * rows, p.shape[0]), *offsets[1:])
        segments.append(Segment(name, shape, offsets, tuple(local.shape), 0, local.numel(), local.detach().view(-1),
                                p, 0, first and hsdp_replica(p) == 0))
    return segments
