"""Context parallel (CP): the sequence dim of every activation is sharded over the cp ranks; attention, the
one layer that mixes positions, runs as ring attention.

Sharding. Each sequence is cut into 2*cp equal chunks and rank r keeps chunks r and 2*cp-1-r (zig-zag, or
head-tail). Under a causal mask a late chunk attends to more keys than an early one; pairing an early chunk
with a late one gives every rank the same attention work. A contiguous split (rank r keeps chunks 2r and
2r+1) is available for comparison: there the last rank does 2*cp-1 times the work of the first.
Rotary embeddings need each token's global position: `rank_positions` gives them, in the rank's order.

Communication. Ring attention: each rank's key/value block travels once around the cp ring with
point-to-point sends (`batch_isend_irecv`), cp-1 hops in the forward. The transfer of the next block is
posted before the current block is computed, so that it overlaps with compute. Partial outputs of the blocks
are merged with their log-sum-exp (online softmax). The backward passes the key/value blocks around again,
with the gradients of each block (dK, dV) travelling beside it, cp hops, the last one bringing them home.
Everything outside attention is per token and needs no communication, but for two statistics of MoE layers
that span the sequence: the load-balancing loss's slot counts and probability sums (an all-reduce of 2E
numbers per layer) and, for capacity-based routing only, the expert choices that order each expert's queue
(an all-gather of top_k integers per token). The parameter gradients of the cp ranks are partial sums and
are all-reduced over dp x cp, like data-parallel gradients.

Per block pair (queries of one chunk, keys of another) the work is: none when the key chunk comes after the
query chunk, a causal (triangular) block on the diagonal, a full block otherwise. `step_calls` groups the
pairs of one ring step into as few kernel calls as the layout allows.

Under document masking (`model.attn_mask = "document"`) the document positions are sharded like the tokens, and
`document_calls` plans each ring step per row and document run instead: a causal square on the diagonal chunk, a
full block against an earlier chunk only where the query's document reaches into it, nothing for a key chunk
that shares no document with the query chunk (planned once per micro-batch, merged by log-sum-exp as above).
`ring_work` counts the query-key pairs each rank computes, the balance of the split.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import shown
from fivefold.layout import raise_problem, sequence_length_problem
from fivefold.models.llama import MoE
from fivefold.models.masking import DocumentMask
from fivefold.parallel import lanes
from fivefold.parallel.attention_ops import attention_backward, attention_forward
from fivefold.parallel.tensor_comm import CollectiveStore, all_gather, all_reduce, kept_through

LAYOUTS = ("zigzag", "contiguous")
_KV_TAG, _GRAD_TAG = 1, 2  # two transfers may be in flight to the same neighbour at once


# ---------------------------------------------------------------------------------------------------------
# Sharding of the sequence dim
# ---------------------------------------------------------------------------------------------------------

def check_sequence_length(seq_len: int, cp: int, field: str = "train.seq_len") -> None:
    """Refuse a sequence length that cannot be cut into 2*cp equal chunks."""
    raise_problem(sequence_length_problem(seq_len, cp, field))


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout = {shown(layout)} is not one of {LAYOUTS}")


def rank_chunks(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunk indices (of 2*cp) that `rank` keeps, in the order it holds them."""
    _check_layout(layout)
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def rank_positions(seq_len: int, rank: int, cp: int, layout: str = "zigzag",
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the tokens that `rank` holds, in its order: the rotary positions of its shard."""
    check_sequence_length(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in rank_chunks(rank, cp, layout)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The part of `x` (full sequence along `dim`) that `rank` holds."""
    check_sequence_length(x.shape[dim], cp)
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in rank_chunks(rank, cp, layout)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full sequence from every rank's shard, given in rank order."""
    cp = len(shards)
    c = shards[0].shape[dim] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        for slot, index in enumerate(rank_chunks(rank, cp, layout)):
            chunks[index] = shard.narrow(dim, slot * c, c)
    return torch.cat(chunks, dim=dim)


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, rank: int, cp: int, layout: str = "zigzag",
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [batch, seq] micro-batch as `rank` trains it: (inputs, targets, rotary positions). `positions`: the
    document positions [batch, seq] under document masking (sharded like the tokens), None for 0..seq-1."""
    if positions is None:
        positions = rank_positions(inputs.shape[1], rank, cp, layout, inputs.device)
    else:
        positions = shard_sequence(positions, rank, cp, layout)
    return shard_sequence(inputs, rank, cp, layout), shard_sequence(targets, rank, cp, layout), positions


# ---------------------------------------------------------------------------------------------------------
# Which blocks each ring step computes
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockCall:
    """One attention kernel call of a ring step: local query slots against local key slots (slots 0 and 1
    are the two chunks a rank holds, each of seq_len / (2*cp) tokens)."""

    q_slots: tuple[int, ...]
    kv_slots: tuple[int, ...]
    causal: bool


def step_calls(rank: int, source: int, cp: int, layout: str = "zigzag") -> list[BlockCall]:
    """The kernel calls of `rank` while it holds the key/value shard of rank `source`.

    A rank's own shard is one causal call over both slots: its chunks are in ascending position order, so the
    causal mask of the concatenation is the true mask (the kernel skips the fully masked tiles). Another
    rank's key chunks are each entirely before or entirely after a query chunk: full or skipped."""
    if source == rank:
        return [BlockCall((0, 1), (0, 1), True)]
    q_chunks, kv_chunks = rank_chunks(rank, cp, layout), rank_chunks(source, cp, layout)
    calls: list[BlockCall] = []
    for slot, q_chunk in enumerate(q_chunks):
        visible = tuple(j for j, kv_chunk in enumerate(kv_chunks) if kv_chunk < q_chunk)
        if not visible:
            continue
        if calls and calls[-1].kv_slots == visible:  # neighbouring query slots seeing the same keys: one call
            calls[-1] = BlockCall(calls[-1].q_slots + (slot,), visible, False)
        else:
            calls.append(BlockCall((slot,), visible, False))
    return calls


def attention_blocks(rank: int, cp: int, layout: str = "zigzag") -> list[tuple[int, int, str]]:
    """The (query chunk, key chunk, kind) pairs that `rank` computes over a whole ring, kind being "full" or
    "causal" (a diagonal block, half the work); fully masked pairs inside a causal call are left out."""
    blocks = []
    for step in range(cp):
        source = (rank - step) % cp
        q_chunks, kv_chunks = rank_chunks(rank, cp, layout), rank_chunks(source, cp, layout)
        for call in step_calls(rank, source, cp, layout):
            for qs, ks in itertools.product(call.q_slots, call.kv_slots):
                qc, kc = q_chunks[qs], kv_chunks[ks]
                if qc > kc:
                    blocks.append((qc, kc, "full"))
                elif qc == kc:
                    blocks.append((qc, kc, "causal"))
    return blocks


def render_blocks(cp: int, layout: str = "zigzag") -> str:
    """The causal chunk grid with the rank that computes each block: a digit for a full block, a letter
    (a = rank 0) for a diagonal causal block, '.' for a masked one that nobody computes."""
    n = 2 * cp
    grid = [["."] * n for _ in range(n)]
    for rank in range(cp):
        for q_chunk, kv_chunk, kind in attention_blocks(rank, cp, layout):
            grid[q_chunk][kv_chunk] = str(rank) if kind == "full" else chr(ord("a") + rank)
    lines = [f"{layout}, cp = {cp}", "key chunk  " + " ".join(f"{j:>2}" for j in range(n))]
    lines += [f"query {i:>2}   " + " ".join(f"{c:>2}" for c in row) for i, row in enumerate(grid)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------------------

class Transfer:
    """A posted ring shift; `wait()` returns the tensor received from the previous rank."""

    def __init__(self, received: torch.Tensor, works: list) -> None:
        self.received, self.works = received, works

    @torch.compiler.disable  # communication stays out of compiled graphs, as ring_shift does
    def wait(self) -> torch.Tensor:
        for work in self.works:
            lanes.wait(work)
        self.works = []
        return self.received


@torch.compiler.disable  # point-to-point is not traceable: under a compiled block it runs eagerly, whatever the group
def ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup, tag: int = 0) -> Transfer:
    """Post: send `tensor` to the next rank of the cp ring, receive the previous rank's into a new buffer."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:
        return Transfer(tensor, [])
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group, tag),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group, tag)]
    return Transfer(received, dist.batch_isend_irecv(ops))


def _rows(slots: tuple[int, ...], chunk: int) -> slice:
    return slice(slots[0] * chunk, (slots[-1] + 1) * chunk)


# One attention kernel call of a ring step, in this rank's local indices: (rows of the batch, query rows of the
# rank's shard, key rows of the visiting shard, causal diagonal block or not).
Call = tuple[slice, slice, slice, bool]


def causal_calls(rank: int, cp: int, layout: str, chunk: int) -> list[list[Call]]:
    """The calls of each ring step under the causal mask (`step_calls`), for all rows of the batch at once."""
    every_row = slice(None)
    return [[(every_row, _rows(c.q_slots, chunk), _rows(c.kv_slots, chunk), c.causal)
             for c in step_calls(rank, (rank - step) % cp, cp, layout)] for step in range(cp)]


def document_calls(positions: torch.Tensor, rank: int, cp: int, layout: str = "zigzag") -> list[list[Call]]:
    """The calls of each ring step under document masking, from this rank's document positions [batch, 2 * chunk]
    (its zig-zag chunks of `document_positions`). A query at global index i with document position p sees the keys
    i - p <= j <= i. Per row and query chunk, each document's run of queries makes one call per visible key chunk:
    a causal square on the diagonal chunk, a full block against an earlier chunk, where the document reaches into
    it (only a chunk's first document can). A key chunk that shares no document with a query chunk costs nothing."""
    chunk = positions.shape[1] // 2
    seq_len = 2 * chunk * cp
    mine = rank_positions(seq_len, rank, cp, layout)
    starts = (mine - positions.cpu()).tolist()  # global index of each query's document start
    # per row and query chunk, the runs of queries of one document: the same at every ring step
    runs = [[(q_chunk, _runs(row, q_slot * chunk, (q_slot + 1) * chunk))
             for q_slot, q_chunk in enumerate(rank_chunks(rank, cp, layout))] for row in starts]
    steps = []
    for step in range(cp):
        kv_chunks = rank_chunks((rank - step) % cp, cp, layout)
        calls: list[Call] = []
        for b, row_runs in enumerate(runs):
            for q_chunk, chunk_runs in row_runs:
                for lo, hi, doc_start in chunk_runs:
                    for kv_slot, kv_chunk in enumerate(kv_chunks):
                        kv_lo = kv_slot * chunk
                        if kv_chunk == q_chunk:  # the diagonal: the run against itself
                            calls.append((slice(b, b + 1), slice(lo, hi), slice(lo, hi), True))
                        elif kv_chunk < q_chunk and doc_start < (kv_chunk + 1) * chunk:
                            first = max(doc_start - kv_chunk * chunk, 0)
                            calls.append((slice(b, b + 1), slice(lo, hi), slice(kv_lo + first, kv_lo + chunk), False))
        steps.append(calls)
    return steps


def call_pairs(calls: list[Call], rows: int) -> int:
    """Query-key pairs that `calls` compute (a causal square of n queries: n(n+1)/2), `rows` rows per call over
    the whole batch."""
    total = 0
    for batch, q_rows, kv_rows, causal in calls:
        n, m = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start
        total += (n * (n + 1) // 2 if causal else n * m) * (rows if batch == slice(None) else 1)
    return total


def ring_work(positions: torch.Tensor, cp: int, layout: str = "zigzag", causal: bool = False) -> list[int]:
    """Query-key pairs each cp rank computes over the ring for sequences with document positions [batch, seq]
    (`causal`: the same sequences under the causal mask): the attention work of each rank, whose largest and
    smallest show how well the split balances under a document-length distribution."""
    work = []
    for rank in range(cp):
        shard = shard_sequence(positions, rank, cp, layout)
        steps = (causal_calls(rank, cp, layout, shard.shape[1] // 2) if causal
                 else document_calls(shard, rank, cp, layout))
        work.append(sum(call_pairs(calls, positions.shape[0]) for calls in steps))
    return work


def _runs(doc_starts: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(first, stop, document start) of the runs of equal document start in doc_starts[lo:hi]."""
    runs, first = [], lo
    for i in range(lo + 1, hi + 1):
        if i == hi or doc_starts[i] != doc_starts[first]:
            runs.append((first, i, doc_starts[first]))
            first = i
    return runs


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: tuple[slice, slice, slice], block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Online softmax: fold one block's (out, lse) into the running fp32 (out, lse) of the rows."""
    old_lse = lse[rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[rows] = (out[rows] * torch.exp(old_lse - new_lse).unsqueeze(-1)
                 + block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse[rows] = new_lse


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                           layout: str = "zigzag", overlap: bool = True,
                           calls: list[list[Call]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of ring attention, without autograd: (out, lse) of this rank's queries. `calls`: the kernel
    calls of each ring step (`document_calls`); None for the causal mask.

    `overlap=False` waits for each key/value transfer before computing the block it held, which serialises
    communication and compute; it exists to measure how much of the transfer time the overlap hides."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    b, h, s, d = q.shape
    calls = calls if calls is not None else causal_calls(rank, cp, layout, s // 2)
    # [batch, seq, heads, head_dim] in memory, like SDPA's output: the model's transpose-reshape to [batch, seq,
    # hidden] is then a view, and the output projection saves the same storage as this function
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])  # one message per hop
    for step in range(cp):
        incoming = ring_shift(kv, group, _KV_TAG) if step < cp - 1 else None  # in flight during the compute
        if incoming is not None and not overlap:
            incoming.wait()
        for batch, rows, cols, causal in calls[step]:
            block_out, block_lse = attention_forward(q[batch, :, rows], kv[0][batch, :, cols], kv[1][batch, :, cols],
                                                     causal)
            _merge(out, lse, (batch, slice(None), rows), block_out, block_lse)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


class RingAttention(torch.autograd.Function):
    """Causal (or document-masked) attention of this rank's queries against the keys/values of every rank of
    `group`.

    q [batch, heads, local_seq, head_dim], k and v [batch, kv_heads, local_seq, head_dim], each rank holding
    its two chunks as `shard_sequence` lays them out; `calls` as in `ring_attention_forward`.

    `store` (a `tensor_comm.CollectiveStore`, under selective recompute): the forward keeps its output and
    log-sum-exp there, outside the selective policy's cache, and the recomputation takes them back instead of
    passing the keys and values around the ring again."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                layout: str, calls: list[list[Call]] | None = None, store: CollectiveStore | None = None
                ) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        calls = calls if calls is not None else causal_calls(rank, cp, layout, q.shape[2] // 2)
        out, lse = kept_through(store, lambda: ring_attention_forward(q, k, v, group, layout, calls=calls))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.calls = group, calls
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, calls = ctx.group, ctx.calls
        cp = dist.get_world_size(group)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        grad_kv_transfer: Transfer | None = None
        for step in range(cp):
            incoming = ring_shift(kv, group, _KV_TAG) if step < cp - 1 else None
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # for the visiting shard
            for batch, rows, cols, causal in calls[step]:
                q_rows = (batch, slice(None), rows)
                dq, dk, dv = attention_backward(grad_out[q_rows], q[q_rows], kv[0][batch, :, cols],
                                                kv[1][batch, :, cols], out[q_rows], lse[q_rows], causal)
                grad_q[q_rows] += dq
                grad_kv[0][batch, :, cols] += dk
                grad_kv[1][batch, :, cols] += dv
            if grad_kv_transfer is not None:  # what the previous ranks accumulated for the same shard
                grad_kv += grad_kv_transfer.wait()
            grad_kv_transfer = ring_shift(grad_kv, group, _GRAD_TAG)  # the last hop brings it home
            if incoming is not None:
                kv = incoming.wait()
        grad_kv = grad_kv_transfer.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                   layout: str = "zigzag") -> torch.Tensor:
    """Causal (grouped-query) attention over a sequence sharded on the ranks of `group` by `shard_sequence`."""
    _check_layout(layout)
    return RingAttention.apply(q, k, v, group, layout)


# ---------------------------------------------------------------------------------------------------------
# Applying it to the model
# ---------------------------------------------------------------------------------------------------------

class RingAttentionCore:
    """Replacement of `Attention.core(q, k, v, mask)`: the same causal or document-masked attention, over the cp
    group's ring. `collective_store`: set by selective recompute around its block (see `RingAttention`)."""

    def __init__(self, group: dist.ProcessGroup, layout: str = "zigzag") -> None:
        _check_layout(layout)
        self.group, self.layout = group, layout
        self.collective_store: CollectiveStore | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None) -> (
        torch.Tensor
    ):
        if mask is None:
            return RingAttention.apply(q, k, v, self.group, self.layout, None, self.collective_store)
        key = ("ring", self.layout)  # the calls of a micro-batch, planned once for all its layers
        if key not in mask.cache:
            rank, cp = dist.get_rank(self.group), dist.get_world_size(self.group)
            mask.cache[key] = document_calls(mask.positions, rank, cp, self.layout)
        return RingAttention.apply(q, k, v, self.group, self.layout, mask.cache[key], self.collective_store)


class _AllReduceSum(torch.autograd.Function):
    """Sum over `group`, backward the same sum: every rank's result depends on every rank's input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad, ctx.group), None


class ContextParallelLoadBalancing:
    """Replacement of `MoE.load_balancing_loss`: the Switch and sequence-wise losses are products of two means over
    the tokens of the micro-batch or of each sequence, which the cp ranks share, so the slot counts and score sums
    (per sequence and expert) are summed over the cp group first. Every cp rank then holds the single-process
    loss; the score sums' backward sums the gradient of every rank's copy."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup) -> None:
        self.moe, self.group = moe, group

    def __call__(self, slot_counts: torch.Tensor, prob_sums: torch.Tensor, tokens: int) -> torch.Tensor:
        # one all-reduce of the 2 E numbers per sequence (the counts carry no gradient; the sums' backward sums over
        # the group)
        both = _AllReduceSum.apply(torch.cat([slot_counts, prob_sums], -1), self.group)
        counts, sums = both.split(self.moe.n_experts, -1)
        return MoE.load_balancing_loss(self.moe, counts, sums, tokens * dist.get_world_size(self.group))


class ContextParallelExpertSlots:
    """Replacement of `MoE.expert_slots` for capacity-based routing: an expert's queue holds the tokens of the
    whole sequences in order, so each rank all-gathers the expert choices of the micro-batch (top_k integers
    per token) over the cp group, computes the single-process queue positions and capacity, and keeps its
    own tokens' positions. Installed for capacity-based routing only: dropless routing needs no positions
    beyond the rank's own."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup, layout: str = "zigzag") -> None:
        self.moe, self.group, self.layout = moe, group, layout

    def __call__(self, flat_expert: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        gathered = all_gather(flat_expert, 0, self.group)
        shards = list(gathered.view(cp, rows, -1, self.moe.top_k))
        whole = unshard_sequence(shards, self.layout, dim=1)
        slot, capacity = MoE.expert_slots(self.moe, whole.reshape(-1), rows)
        return shard_sequence(slot.view(whole.shape), rank, cp, self.layout, dim=1).reshape(-1), capacity


def apply_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup, layout: str = "zigzag") -> nn.Module:
    """Make every attention block of `model` run ring attention over `cp_group`, in place, and every MoE layer
    compute its load-balancing statistics and capacity over the whole sequences.

    The model then expects each rank's shard of the sequence (`shard_batch`) with its rotary positions passed
    to `forward` / `forward_hidden`; the rest of the model is per token and unchanged."""
    for block in model.layers.values():
        block.attn.core = RingAttentionCore(cp_group, layout)
        moe = block.mlp
        if isinstance(moe, MoE):
            balancing = ContextParallelLoadBalancing(moe, cp_group)
            moe.load_balancing_loss = install_inner(moe.load_balancing_loss, balancing)
            if moe.capacity_factor > 0:  # dropless routing needs no positions beyond the rank's own
                moe.expert_slots = install_inner(moe.expert_slots, ContextParallelExpertSlots(moe, cp_group, layout))
    return model


def install_inner(current, split):
    """`split` as a routing statistic's replacement: in place of the plain method, or as the `inner` of the outer
    split already installed (tensor parallel's token split, `fivefold.parallel.tensor.TokenSplitMoE`), which gathers
    over tp first and passes the cp-local whole to `split`."""
    if hasattr(current, "inner"):
        current.inner = split
        return current
    return split
