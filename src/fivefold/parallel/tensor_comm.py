"""Where tensor and sequence parallelism talk to other ranks: autograd operators over the tp group.

Megatron's conjugate pair for a column-parallel linear followed by a row-parallel one:

    copy_to_tp       (f)  forward identity,             backward all-reduce
    reduce_from_tp   (g)  forward all-reduce,           backward identity

With sequence parallelism the all-reduce of g becomes a reduce-scatter along the sequence, and the
identity of f an all-gather along the sequence (their backwards swap roles):

    gather_sequence          forward all-gather (dim 1),   backward reduce-scatter (dim 1)
    scatter_sequence         forward reduce-scatter,       backward all-gather
    gather_linears           gather_sequence fused with the column-parallel linears that share the input,
                             keeping only the local slice (backward all-gathers it again)

`vocab_parallel_cross_entropy_sum` is the loss over a vocabulary-sharded output layer: per chunk of tokens
one all-reduce of the row maxima and one of (sum of exponentials, target logit), never the full logits.

Activations are batch-first, [batch, seq, hidden]; the sequence is dim 1. Every operator is the identity
(and talks to nobody) when the group has one rank.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fivefold.layout import SCATTER_PIECES
from fivefold.models.llama import autocast_dtype
from fivefold.models.loss import chunked_output_loss, scaled_saved_gradients
from fivefold.parallel import lanes

SEQ_DIM = 1
# the single-tensor collectives under their new names (torch >= 2.13), the old ones before (2.11 on the GPU
# machines): every caller in fivefold goes through these two
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> (
    torch.Tensor
):
    out = x.clone(memory_format=torch.contiguous_format)
    lanes.collective(dist.all_reduce, out, op=op, group=group)
    return out


def all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    out, work = start_all_gather(x, dim, group, async_op=lanes.active())
    lanes.wait(work)
    return out


def reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    out, work = start_reduce_scatter(x, dim, group, async_op=lanes.active())
    lanes.wait(work)
    return out


def start_all_gather(x: torch.Tensor, dim: int, group: ProcessGroup, async_op: bool = True
                     ) -> tuple[torch.Tensor, dist.Work | None]:
    """`all_gather`, asynchronously by default: its output (valid once the work is waited for) and the work."""
    size = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * size, *front.shape[1:]))
    work = all_gather_into(out, front, group=group, async_op=async_op)
    return out.movedim(0, dim), work


def sequence_split(length: int, size: int) -> int:
    """The rows of each of `size` tp ranks' slices of a sequence `length` long; refused unless they divide it."""
    if length % size:
        raise ValueError(
            f"sequence parallelism splits the sequence over tp = {size} ranks, but the sequence length is "
            f"{length}; use a sequence length divisible by {size}"
        )
    return length // size


def start_reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup, async_op: bool = True
                         ) -> tuple[torch.Tensor, dist.Work | None]:
    """`reduce_scatter`, asynchronously by default: its output (valid once the work is waited for) and the work."""
    size = dist.get_world_size(group)
    part = sequence_split(x.shape[dim], size)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((part, *front.shape[1:]))
    work = reduce_scatter_into(out, front, group=group, async_op=async_op)
    return out.movedim(0, dim), work



# true while a store's caller computes a result the store keeps whole (`CollectiveStore.through`): the selective
# recompute policy caches nothing of that work, whose recomputation never runs (`recompute.selective_policy`)
_KEPT_WHOLE = contextvars.ContextVar("fivefold_kept_whole", default=False)


def computing_kept_whole() -> bool:
    """Whether the work running now computes a result that a `CollectiveStore` keeps whole."""
    return _KEPT_WHOLE.get()


class CollectiveStore:
    """The outputs of one checkpointed block's collectives, kept by its forward and handed back in its selective
    recomputation (`recompute.block_contexts`), so that the recomputation communicates nothing. Selective recompute
    keeps the outputs of every matmul (`recompute.SAVED_OPS`), which the recomputation takes from the checkpoint's
    cache in the order they ran; the recomputed forward therefore calls the same matmuls in the same order, on
    stand-in inputs where a collective's output would have been: the gathered linears' gathered input (which only
    feeds matmuls) is not kept at all, the row linears' reduce-scattered output (which the next norm reads) is kept,
    1/tp of the sequence. Ring attention's result and the expert-parallel exchanges' are kept too
    (`context.RingAttention`, `expert.ExpertParallelDispatch`)."""

    def __init__(self) -> None:
        self.kept: list = []
        self.replay = False

    def keep(self, out: torch.Tensor) -> None:
        self.kept.append(out.detach())

    def take(self):
        return self.kept.pop(0)

    def through(self, compute: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]):
        """`compute()`'s tensor (or tuple of tensors): in the original forward computed, with nothing of the work
        cached by the selective policy (the result is kept whole here), and kept; in the recomputation handed back
        without computing or communicating."""
        if self.replay:
            return self.take()
        token = _KEPT_WHOLE.set(True)
        try:
            result = compute()
        finally:
            _KEPT_WHOLE.reset(token)
        self.kept.append(tuple(t.detach() for t in result) if isinstance(result, tuple) else result.detach())
        return result


def kept_through(store: CollectiveStore | None, compute: Callable):
    """`store.through(compute)`, or `compute()` where there is no store (no selective recompute)."""
    return compute() if store is None else store.through(compute)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherSequenceParts(_GatherSequence):
    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, SEQ_DIM)[rank].contiguous(), None


class _GradOnFirstRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.first = dist.get_rank(group) == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.first else torch.zeros_like(grad)), None


class _GatherLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, queue, params: tuple[torch.Tensor, ...] | None,
                overlap: bool, store: CollectiveStore | None, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device, dtype = x.device.type, autocast_dtype(x)  # reused in backward, which autocast does not reach
        with torch.autocast(device, enabled=False):
            xc, ws = x.to(dtype), tuple(w.to(dtype) for w in weights)
            if overlap and not torch.compiler.is_compiling():
                outs = gathered_matmuls(xc, ws, group, replay=store is not None and store.replay)
            else:
                x_full = all_gather(xc, SEQ_DIM, group)
                outs = tuple(x_full @ w.t() for w in ws)
        ctx.group, ctx.dtype, ctx.queue, ctx.params, ctx.overlap = group, dtype, queue, params, overlap
        ctx.save_for_backward(x, *weights)  # the local slice only: the gathered input is rebuilt in backward
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grads = tuple(grad.to(ctx.dtype) for grad in grads)
        none = (None,) * (5 + len(weights))  # group, queue, params, overlap, store and the weights
        # overlapped (`gather_linears(overlap=True)`, without a queue): the input's all-gather runs under the
        # input gradient's matmuls, the input gradient's reduce-scatter under the weight gradients' (Megatron's
        # order); both on the tp group, launched in the same order on every rank, each waited for before it is read
        gather = None
        overlap = ctx.overlap and ctx.queue is None
        if overlap:
            x_full, gather = start_all_gather(x.to(ctx.dtype), SEQ_DIM, ctx.group)
        grad_x_full = sum(grad @ w.to(ctx.dtype) for grad, w in zip(grads, weights, strict=True))
        lanes.wait(gather)
        grad_x, scatter = start_reduce_scatter(grad_x_full, SEQ_DIM, ctx.group, async_op=overlap)
        gathered = [x_full.reshape(-1, x_full.shape[-1])] if overlap else []

        def x_rows() -> torch.Tensor:  # gathered once, for all the weights that share the input
            if not gathered:
                rows = all_gather(x.to(ctx.dtype), SEQ_DIM, ctx.group)
                gathered.append(rows.reshape(-1, rows.shape[-1]))
            return gathered[0]

        def weight_grad(grad: torch.Tensor) -> torch.Tensor:
            return grad.reshape(-1, grad.shape[-1]).t() @ x_rows()

        if ctx.queue is not None:  # a pipeline's W pass computes them (and gathers the input again then)
            for grad, param in zip(grads, ctx.params, strict=True):
                ctx.queue.defer(param, lambda grad=grad: weight_grad(grad))
            return grad_x.to(x.dtype), *none
        weight_grads = [weight_grad(g).to(w.dtype) for g, w in zip(grads, weights, strict=True)]
        lanes.wait(scatter)
        return grad_x.to(x.dtype), *none[:5], *weight_grads


def sequence_part(rank: int, part: int) -> slice:
    """The rows of tp rank `rank`'s slice of the sequence, `part` rows long."""
    return slice(rank * part, (rank + 1) * part)


def other_parts(group: ProcessGroup, part: int) -> list[slice]:
    """The rows of every other tp rank's slice of the sequence, in rank order."""
    rank = dist.get_rank(group)
    return [sequence_part(r, part) for r in range(dist.get_world_size(group)) if r != rank]


def gathered_matmuls(x: torch.Tensor, weights: tuple[torch.Tensor, ...], group: ProcessGroup, replay: bool = False
                     ) -> tuple[torch.Tensor, ...]:
    """`all_gather(x) @ w.T` for each weight, [b, tp * s, out], with the all-gather of the slice `x` [b, s, h]
    running under the matmuls of this rank's own rows, which need no other rank (a collective matmul: the
    other ranks' rows are multiplied once they arrive). Each output row is the same dot product as in the
    gathered matmul. `replay` (a selective recomputation, `CollectiveStore`): the matmuls' outputs come from the
    checkpoint's cache, so the other ranks' rows are not gathered (an uninitialised stand-in goes in their place)."""
    size, rank, part = dist.get_world_size(group), dist.get_rank(group), x.shape[SEQ_DIM]
    if replay:
        x_full, gather = x.new_empty(x.shape[0], part * size, *x.shape[2:]), None
    else:
        x_full, gather = start_all_gather(x, SEQ_DIM, group)
    outs = tuple(x.new_empty(x.shape[0], part * size, w.shape[0]) for w in weights)
    for out, w in zip(outs, weights, strict=True):
        out[:, sequence_part(rank, part)] = x @ w.t()
    lanes.wait(gather)
    for rows in other_parts(group, part):
        for out, w in zip(outs, weights, strict=True):
            out[:, rows] = x_full[:, rows] @ w.t()
    return outs


class _LinearScatter(torch.autograd.Function):
    """`reduce_scatter(x @ weight.T)` along the sequence (a row-parallel linear and sequence parallel's exit),
    overlapped: forward reduce-scatters the output in `SCATTER_PIECES` pieces, each under the next piece's matmul;
    backward all-gathers the output gradient under the input- and weight-gradient matmuls of this rank's own
    rows, then multiplies the other ranks' rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, store: CollectiveStore | None, weight: torch.Tensor
                ) -> torch.Tensor:
        device, dtype = x.device.type, autocast_dtype(x)  # reused in backward, which autocast does not reach
        size = dist.get_world_size(group)
        part = sequence_split(x.shape[SEQ_DIM], size)
        pieces = SCATTER_PIECES if part % SCATTER_PIECES == 0 else 1
        b, rows = x.shape[0], part // pieces
        replay = store is not None and store.replay
        with torch.autocast(device, enabled=False):
            xc, w = x.to(dtype), weight.to(dtype)
            # [b, tp, pieces, rows, k]: piece p holds rows p * rows ... of every rank's slice
            split = xc.reshape(b, size, pieces, rows, xc.shape[-1])
            outs, works = [], []
            for piece in range(pieces):
                partial = split[:, :, piece].transpose(0, 1) @ w.t()  # [tp, b, rows, h]
                if replay:  # the matmul came from the checkpoint's cache; its reduction from the store below
                    continue
                out = partial.new_empty(partial.shape[1:])
                works.append(reduce_scatter_into(out, partial.flatten(0, 1), group=group, async_op=True))
                outs.append(out)
            for work in works:
                lanes.wait(work)
        ctx.group, ctx.dtype = group, dtype
        ctx.save_for_backward(x, weight)
        if replay:
            return store.take()
        out = torch.cat(outs, dim=SEQ_DIM) if pieces > 1 else outs[0]
        if store is not None:
            store.keep(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        part = grad.shape[SEQ_DIM]
        grad, w, xc = grad.to(ctx.dtype), weight.to(ctx.dtype), x.to(ctx.dtype)
        grad_full, gather = start_all_gather(grad, SEQ_DIM, ctx.group)
        grad_x = grad.new_empty(xc.shape)

        def rows_grads(g: torch.Tensor, rows: slice) -> torch.Tensor:  # input rows' gradient; their weight share
            grad_x[:, rows] = g @ w
            return g.reshape(-1, g.shape[-1]).t() @ xc[:, rows].reshape(-1, xc.shape[-1])

        grad_w = rows_grads(grad, sequence_part(dist.get_rank(ctx.group), part))
        lanes.wait(gather)
        for rows in other_parts(ctx.group, part):
            grad_w += rows_grads(grad_full[:, rows], rows)
        return grad_x.to(x.dtype), None, None, grad_w.to(weight.dtype)


def _single(group: ProcessGroup) -> bool:
    return dist.get_world_size(group) == 1


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f: the input of a column-parallel region; its gradients, partial per rank, are all-reduced."""
    return x if _single(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g: the partial sums out of a row-parallel region are all-reduced."""
    return x if _single(group) else _ReduceFromTP.apply(x, group)


def gather_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sequence-parallel f: all-gather the sequence slices [b, s/tp, h] -> [b, s, h]."""
    return x if _single(group) else _GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sequence-parallel g: reduce-scatter the partial sums [b, s, h] -> this rank's slice [b, s/tp, h]."""
    return x if _single(group) else _ScatterSequence.apply(x, group)


def own_sequence_part(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's 1/tp of the sequence of `x` [b, s, h], held whole on every tp rank (inside a region entered by
    f, whose backward sums the ranks' parts of the gradient)."""
    size = dist.get_world_size(group)
    return x if size == 1 else x.chunk(size, SEQ_DIM)[dist.get_rank(group)]


def gather_sequence_parts(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather the tp ranks' whole results for their parts of the sequence [b, s/tp, h] -> [b, s, h]; the
    gradient that comes back is the same on every rank (the region's output is replicated), so backward keeps the
    rank's part of it (no sum, unlike `gather_sequence`)."""
    return x if _single(group) else _GatherSequenceParts.apply(x, group)


def gather_linears(x: torch.Tensor, group: ProcessGroup, *weights: torch.Tensor, weight_grad_queue=None,
                   overlap: bool = False, store: CollectiveStore | None = None) -> tuple[torch.Tensor, ...]:
    """Sequence-parallel input of column-parallel linears sharing it (q/k/v, gate/up): one all-gather of the
    sequence slices [b, s/tp, h], then `x_full @ w.T` for each weight. Only the slice is kept for backward,
    which all-gathers it again for the weight gradients and reduce-scatters the input gradient (as
    Megatron does), so SP holds 1/tp of these activations where TP alone holds them whole. With a
    `weight_grad_queue` (a pipeline's zero-bubble schedules) backward computes only the input gradient and leaves
    the all-gather and the weight gradients to the queue's W pass. `overlap` (`layout.tp_comm_overlap`): forward
    runs the all-gather under this rank's own rows' matmuls (`gathered_matmuls`); without a queue, backward runs
    the all-gather under the input gradient's matmuls and the reduce-scatter under the weight gradients'
    (asynchronous collectives), the same values in the same order; `store` in replay (a selective
    recomputation, `CollectiveStore`) gathers nothing."""
    if _single(group):
        return tuple(x @ w.t() for w in weights)
    if weight_grad_queue is not None:  # weights enter detached: B leaves their gradients to the W pass
        return _GatherLinears.apply(x, group, weight_grad_queue, weights, overlap, store,
                                    *(w.detach() for w in weights))
    return _GatherLinears.apply(x, group, None, None, overlap, store, *weights)


def linear_scatter(x: torch.Tensor, group: ProcessGroup, weight: torch.Tensor,
                   store: CollectiveStore | None = None) -> torch.Tensor:
    """A bias-free row-parallel linear and sequence parallel's exit, `scatter_sequence(x @ weight.T)`, with both
    directions' collectives overlapped with its matmuls (`layout.tp_comm_overlap`; see `_LinearScatter`); `store`
    keeps its output for a selective recomputation (`CollectiveStore`)."""
    if _single(group):
        return x @ weight.t()
    if torch.compiler.is_compiling():  # a compiled graph holds the collectives in the sequential order
        return scatter_sequence(x @ weight.t(), group)
    return _LinearScatter.apply(x, group, store, weight)


def enter_tp_region(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel region: f, or the sequence all-gather under SP."""
    return gather_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)


def exit_tp_region(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """The output of a row-parallel region: g, or the sequence reduce-scatter under SP."""
    return scatter_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)


def grad_on_first_rank(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; backward passes the gradient on tp rank 0 and zeros elsewhere.

    For a branch inside a tp region that every rank computes identically (the MoE router): its gradient is
    full, not partial, on every rank, so the region's input reduction must count it once. Adding zeros is
    exact, unlike dividing by tp."""
    return x if _single(group) else _GradOnFirstRank.apply(x, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                chunk: int, compute_dtype: torch.dtype, group: ProcessGroup) -> torch.Tensor:
        local_vocab = weight.shape[0]

        def chunk_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, needs_grad: bool):
            logits = (h @ w.t()).float()  # [chunk, local vocab]: the only logits alive
            row_max = logits.max(dim=-1).values
            lanes.collective(dist.all_reduce, row_max, op=dist.ReduceOp.MAX, group=group)
            logits -= row_max[:, None]
            valid = t != -100
            local_t = t - vocab_start
            here = valid & (local_t >= 0) & (local_t < local_vocab)
            local_t = torch.where(here, local_t, 0)
            target_logit = logits.gather(1, local_t[:, None]).squeeze(1) * here
            exps = logits.exp_()
            stats = torch.stack([exps.sum(-1), target_logit])  # one all-reduce for both
            lanes.collective(dist.all_reduce, stats, group=group)
            sum_exp, target_logit = stats[0], stats[1]
            loss = ((sum_exp.log() - target_logit) * valid).sum()
            if not needs_grad:
                return loss, None
            g = exps.div_(sum_exp[:, None])  # local slice of the softmax
            g.scatter_add_(1, local_t[:, None], -here[:, None].to(g.dtype))
            g *= valid[:, None]
            # the hidden gradient it gives is partial: this vocab slice's only
            return loss, g.to(compute_dtype)

        return chunked_output_loss(ctx, hidden, weight, targets, chunk, compute_dtype, chunk_loss)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return scaled_saved_gradients(ctx, grad_out, 5)


def vocab_parallel_cross_entropy_sum(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor,
                                     vocab_start: int, group: ProcessGroup, chunk_tokens: int,
                                     compute_dtype: torch.dtype) -> torch.Tensor:
    """Summed cross-entropy of full hidden rows [tokens, hidden] against `targets` (-100 ignored), with this
    rank's rows `weight_shard` [vocab / tp, hidden] of the output layer starting at `vocab_start`.

    The same value on every rank. The gradient to `hidden` is this vocab slice's part only: the caller
    feeds `hidden` through `copy_to_tp` or `gather_sequence`, whose backward sums the parts."""
    return _VocabParallelCrossEntropy.apply(hidden, weight_shard, targets, vocab_start, chunk_tokens,
                                            compute_dtype, group)
