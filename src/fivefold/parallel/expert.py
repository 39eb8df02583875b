"""Expert parallel (EP): the routed experts of every MoE layer sharded over the ranks of an ep group.

Expert parallel adds no ranks: it folds over the dp x cp ranks (see `fivefold.parallel.mesh`), which hold
different tokens, so an ep group is a block of ep ranks of one dp x cp group (one tp coordinate).

What is sharded. Rank r of an ep group holds experts [r E/ep, (r+1) E/ep) of each layer's batched weights
`w_gate`, `w_up`, `w_down` (first dim E/ep, plain names kept; under tp each expert's ffn dim is further split
by `fivefold.parallel.tensor`). The router and the shared experts are replicated, like every dense weight.
Gradients of the expert weights are summed over the `edp` group (the ranks that hold the same experts:
dp x cp / ep of them), dense gradients over dp x cp.

What is communicated, per MoE layer and micro-batch (see `expert_comm`), with T tokens on the rank, k the
top-k and h the hidden size:

1. routing runs locally, on the rank's own tokens, as in one process: the same top-k, the same capacity (per
   source rank and expert, from the rank's micro-batch) and so the same dropped slots;
2. the counts of kept slots per destination expert are exchanged (an all-to-all of E integers);
3. dispatch: the kept slots' hidden states, grouped by destination, go out in one all-to-all with uneven
   splits (about T k h elements sent and received per rank when the load is balanced; (ep-1)/ep of it
   leaves the rank);
4. the local experts run on the received rows, sorted by local expert on the device, as one grouped matmul
   (`MoE.grouped_experts`; or packed into one padded batched matmul under `model.moe_impl = "padded"`);
5. combine: the expert outputs return by the reverse all-to-all (same volume), and each token sums its
   outputs scaled by its routing weights.

The shared experts run while the dispatch's rows travel (`expert_comm.all_to_all_beside`): the exchange is launched
asynchronously, the shared experts' matmuls run, then the layer waits for the rows. On accelerators the exchange
runs on the communicator's stream beside the compute stream; on the CPU gloo moves the rows in its own thread while
the main thread computes. The order on every rank is: counts exchange, dispatch launched, shared experts, wait,
routed experts, combine. Backward exchanges synchronously (see `_AllToAllStart`). Under tensor parallel the shared
experts' collectives (f/g, or the all-gather and reduce-scatter) stay outside that window, so no two
communicators' collectives are ever in flight at once.

Backward runs the two all-to-alls in reverse order with the splits swapped. The host reads the count tables once
(the split sizes), and a recomputed forward reuses them (`fivefold.parallel.recompute`). The load-balancing loss stays
local to the rank's micro-batch (summed over cp by `fivefold.parallel.context`), as in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from fivefold.models.llama import Llama, MoE, autocast_dtype, expert_counts
from fivefold.parallel.expert_comm import all_to_all, all_to_all_beside, exchange_counts, kept_all_to_all
from fivefold.parallel.tensor_comm import CollectiveStore, kept_through

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # batched routed-expert weights; dim 0 is the expert


def is_expert_param(name: str) -> bool:
    """Whether plain-model parameter `name` is a routed expert's weight (sharded over ep along dim 0)."""
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def shard_expert_state(state: dict[str, torch.Tensor], ep_rank: int, ep: int) -> dict[str, torch.Tensor]:
    """This ep rank's experts of a state whose expert weights hold every expert (other tensors unchanged)."""
    return {name: t.chunk(ep, 0)[ep_rank].clone() if is_expert_param(name) else t for name, t in state.items()}


def gather_expert_state(state: dict[str, torch.Tensor], ep_group: ProcessGroup) -> dict[str, torch.Tensor]:
    """The state with every expert, from each ep rank's experts (collective over the ep group)."""
    ep = dist.get_world_size(ep_group)
    full = {}
    for name, t in state.items():
        if not is_expert_param(name) or ep == 1:
            full[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.detach().contiguous(), group=ep_group)
        full[name] = torch.cat(parts, 0)
    return full


class ExpertParallelDispatch:
    """Replacement of `MoE.dispatch_combine`: the kept slots travel to the ranks that hold their experts and
    come back (see the module docstring).

    The one host read of a dispatch is the table of counts (this rank's sends and receives per expert), for the
    all-to-all split sizes. Under recompute (`fivefold.parallel.recompute`) the original forward records its
    tables in the layer's `recorded_counts` and the recomputation reads them back from its `replayed_counts`,
    so recompute adds none. Under selective recompute its `collective_store` (`tensor_comm.CollectiveStore`, set
    around the block by `recompute.collectives_kept`) keeps what each exchange received, the counts and the rows
    both ways, and the recomputation takes them from it instead of exchanging again (`expert_comm.kept_all_to_all`:
    its backward still sends the gradients back)."""

    collective_store: CollectiveStore | None = None

    def __init__(self, moe: MoE, group: ProcessGroup) -> None:
        self.moe, self.group = moe, group
        self.ep = dist.get_world_size(group)
        self.local_experts = moe.n_experts // self.ep

    def host_counts(self, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> tuple[list, list]:
        """(send table, receive table) as Python lists of [ep][local experts]: one host read, or none when the
        original forward of a recomputation recorded them."""
        moe = self.moe
        if moe.replayed_counts:
            return moe.replayed_counts.pop(0)
        tables = torch.stack([send_counts, recv_counts]).tolist()
        if moe.recorded_counts is not None:
            moe.recorded_counts.append(tables)
        return tables

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, rows: int = 1,
                 beside=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.moe.impl == "padded":
            return self.padded(x, experts, weights, rows, beside)
        moe, ep, local = self.moe, self.ep, self.local_experts
        flat = experts.reshape(-1)
        keep = moe.kept_mask(flat, rows)
        # dropped slots sort after every expert's (key n_experts) and are not sent
        key = flat if keep is None else torch.where(keep, flat, moe.n_experts)
        order = key.argsort(stable=True)  # grouped by expert, hence by destination rank
        send_counts = expert_counts(key, moe.n_experts + 1)[:moe.n_experts].view(ep, local)
        sent, received, recv_counts, _, splits, shared = self.dispatch(x, order, send_counts, beside)
        # received rows come in blocks (source rank, local expert): sort them by local expert (stable, so
        # earlier source ranks first), run the grouped experts, and put the outputs back in arrival order
        block = torch.repeat_interleave(torch.arange(ep * local, device=x.device), recv_counts.reshape(-1),
                                        output_size=sum(splits[1]))
        by_expert = (block % local).argsort(stable=True)
        out = moe.grouped_experts(received[by_expert], recv_counts.sum(0))
        return self.combine(x, torch.empty_like(out).index_copy(0, by_expert, out), sent, weights, splits), shared

    def dispatch(self, x: torch.Tensor, order: torch.Tensor, send_counts: torch.Tensor, beside=None) -> tuple:
        """Send the rows of the slots `order` (slot indices, grouped by expert; those past the counted ones stay
        home) to their experts' ranks, running `beside()` (the shared experts) while they travel. Returns (the
        slots sent, the rows received, the receive counts [source rank, local expert] on the device and as a table,
        (send splits, receive splits), what `beside` returned or None)."""
        # [source rank, local expert]
        recv_counts = kept_through(self.collective_store, lambda: exchange_counts(send_counts, self.group))
        send_table, recv_table = self.host_counts(send_counts, recv_counts)
        splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
        sent = order[:sum(splits[0])]  # slot indices (token * top_k + choice) in the order they are sent
        rows = x[sent // self.moe.top_k]
        rows = rows.to(autocast_dtype(rows))  # the experts' matmuls take it in that dtype anyway
        received, shared = self.exchange(rows, *splits, beside)
        return sent, received, recv_counts, recv_table, splits, shared

    def exchange(self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], beside=None) -> tuple:
        """(the rows received, what `beside()` returned or None): the all-to-all of `rows`, with `beside()` run while
        they travel; under a selective recomputation the rows its original forward received (`collective_store`),
        without communicating."""
        store = self.collective_store
        if store is not None and store.replay:
            received = kept_all_to_all(rows, store.take(), send_splits, recv_splits, self.group)
            return received, None if beside is None else beside()
        if beside is None:
            received, result = all_to_all(rows, send_splits, recv_splits, self.group), None
        else:
            received, result = all_to_all_beside(rows, send_splits, recv_splits, self.group, beside)
        if store is not None:
            store.keep(received)
        return received, result

    def combine(self, x: torch.Tensor, result: torch.Tensor, sent: torch.Tensor, weights: torch.Tensor,
                splits: tuple[list[int], list[int]]) -> torch.Tensor:
        """Return the expert outputs `result` (in arrival order) to their ranks and sum each token's outputs
        scaled by its routing weights."""
        returned, _ = self.exchange(result, splits[1], splits[0])
        contrib = returned.to(x.dtype) * weights.reshape(-1)[sent].unsqueeze(-1)
        return x.new_zeros(x.shape).index_add_(0, sent // self.moe.top_k, contrib)

    def padded(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, rows: int = 1,
               beside=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`model.moe_impl = "padded"`: the received rows packed by local expert into [local experts, busiest
        expert's rows, hidden] and run as one batched matmul."""
        moe, ep, local = self.moe, self.ep, self.local_experts
        kept, _, _ = moe.kept_slots(experts, rows)
        kept_expert = experts.reshape(-1)[kept]
        send_counts = torch.bincount(kept_expert, minlength=moe.n_experts).view(ep, local)
        sent, received, recv_counts, recv_table, splits, shared = self.dispatch(
            x, kept[kept_expert.argsort(stable=True)], send_counts, beside)
        # received rows come in blocks (source rank, local expert); place each in its expert's packed queue,
        # after the rows of the same expert from earlier source ranks
        block_counts = recv_counts.reshape(-1)
        block = torch.repeat_interleave(torch.arange(block_counts.numel(), device=x.device), block_counts)
        block_start = torch.cumsum(block_counts, 0) - block_counts
        expert_offset = (torch.cumsum(recv_counts, 0) - recv_counts).reshape(-1)
        local_expert = block % local
        position = torch.arange(block.numel(), device=x.device) - block_start[block] + expert_offset[block]
        capacity = max(max(map(sum, zip(*recv_table, strict=True))), 1)
        packed = received.new_zeros(local, capacity, x.shape[1])
        packed[local_expert, position] = received
        result = moe.experts_forward(packed)[local_expert, position]
        return self.combine(x, result, sent, weights, splits), shared


def apply_expert_parallel(model: Llama, ep_group: ProcessGroup) -> None:
    """Keep this rank's experts of every MoE layer of `model` and route tokens over `ep_group`, in place.
    Every rank must hold the same full experts beforehand (built from the same seed); apply after tensor
    parallel (which splits each expert's ffn dim) and before data parallel."""
    ep, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for block in model.layers.values():
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        if moe.n_experts % ep:
            raise ValueError(f"ep = {ep} does not divide the {moe.n_experts} experts")
        for name in EXPERT_WEIGHTS:
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(full.detach().chunk(ep, 0)[ep_rank].clone()))
        moe.dispatch_combine = ExpertParallelDispatch(moe, ep_group)
