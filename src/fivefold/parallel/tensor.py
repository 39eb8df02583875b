"""Tensor parallelism (Megatron style) with optional sequence parallelism, applied to the plain `Llama`.

What is sharded over the tp ranks (each parameter stays a plain `nn.Parameter` holding its local shard,
with its plain-model name, so that data parallel / ZeRO can shard it further):

- attention: q/k/v column-parallel (query heads and grouped-query kv heads split, tp must divide both),
  o_proj row-parallel;
- MLP: gate/up column-parallel, down row-parallel; MoE: each expert's ffn dim of the batched weights split
  the same way, the shared expert likewise; the router is replicated;
- embedding vocabulary-parallel (rows), output layer vocabulary-sharded the same way (tied weights stay
  one parameter);
- norms replicated.

What is communicated (see `tensor_comm`): per attention and per MLP, the input goes through f (backward
all-reduce) and the output through g (forward all-reduce); the embedding output through g; the loss needs
two small all-reduces per chunk of tokens (`vocab_parallel_loss_sum`). With sequence parallelism the
norms and residual adds hold [batch, seq / tp, hidden]: f becomes an all-gather along the sequence
(backward reduce-scatter) and g a reduce-scatter (backward all-gather), the same bytes as one all-reduce.
The all-gather is fused with the q/k/v (gate/up) projections, which keep only the sequence slice for
backward and gather it again there. Under `layout.tp_comm_overlap` each collective of sequence parallel runs
under a matmul: the forward all-gather under the own rows' q/k/v (gate/up) matmuls, the row-parallel linears'
reduce-scatter in pieces under the next piece's matmul, and in backward the all-gathers under the own rows'
gradients and the input gradient's reduce-scatter under the weight gradients (`tensor_comm`).
The norm weights then see only their sequence slice, so each norm's weight enters through f (backward
all-reduce over tp): every replicated parameter ends with the same, full gradient on every tp rank.

The MoE router sees the whole (gathered) sequence, so routing, capacity and the load-balancing loss are
exactly those of one process and identical on every rank. The router's gradient is full on every rank;
it enters the region's reduction from tp rank 0 only (`grad_on_first_rank`), and the combine weights,
which multiply partial expert outputs, go through f so that their gradient is summed.

Modules are turned into their tensor-parallel subclasses in place (as `fully_shard` does), keeping every
parameter name. Apply tensor parallelism before recompute and before data-parallel sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from fivefold.config import ModelConfig
from fivefold.layout import TP_LOSS_CHUNK_TOKENS, raise_problem, tensor_parallel_problem
from fivefold.models.llama import MLP, Attention, Llama, MoE, RMSNorm
from fivefold.parallel.expert import EXPERT_WEIGHTS, is_expert_param
from fivefold.parallel.tensor_comm import (
    CollectiveStore,
    all_gather,
    copy_to_tp,
    enter_tp_region,
    exit_tp_region,
    gather_linears,
    gather_sequence,
    gather_sequence_parts,
    grad_on_first_rank,
    linear_scatter,
    own_sequence_part,
    reduce_from_tp,
    vocab_parallel_cross_entropy_sum,
)

# the dim of a weight that tp splits: a linear weight is [out, in] (the embedding [vocabulary, hidden]), the
# stacked experts' [experts, in, out]; column parallel splits the output features, row parallel the input features
COLUMN = 0
ROW = 1
EXPERT_COLUMN = 2
EXPERT_ROW = 1

# plain-model parameter name suffix -> the dim split over tp (anything else is replicated)
_SHARD_DIMS = {
    "embed.weight": COLUMN, "lm_head.weight": COLUMN,
    "q_proj.weight": COLUMN, "k_proj.weight": COLUMN, "v_proj.weight": COLUMN, "o_proj.weight": ROW,
    "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0,  # (model.qkv_bias) split with their weights' rows
    "gate_proj.weight": COLUMN, "up_proj.weight": COLUMN, "down_proj.weight": ROW,
    "w_gate": EXPERT_COLUMN, "w_up": EXPERT_COLUMN, "w_down": EXPERT_ROW,
}


def tp_shard_dim(param_name: str, split_experts: bool = True) -> int | None:
    """The dim of plain-model parameter `param_name` split over the tp ranks; None when replicated (the routed
    experts' weights too unless `split_experts`: whole experts, `layout.etp = 1`)."""
    if not split_experts and is_expert_param(param_name):
        return None
    for suffix, dim in _SHARD_DIMS.items():
        if param_name == suffix or param_name.endswith("." + suffix):
            return dim
    return None


def shard_for_rank(full_tensor: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s contiguous 1/tp_size block of `full_tensor` along `dim` (the whole tensor if None)."""
    if dim is None:
        return full_tensor
    if full_tensor.shape[dim] % tp_size:
        raise ValueError(f"dim {dim} of size {full_tensor.shape[dim]} does not split over tp = {tp_size}")
    return full_tensor.chunk(tp_size, dim)[tp_rank]


def shard_state(full_state: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                split_experts: bool = True) -> dict[str, torch.Tensor]:
    """This tp rank's shards of a full plain-model state (e.g. a loaded checkpoint)."""
    return {name: shard_for_rank(t, tp_shard_dim(name, split_experts), tp_rank, tp_size).clone()
            for name, t in full_state.items()}


def gather_state(local_state: dict[str, torch.Tensor], tp_group: ProcessGroup,
                 split_experts: bool = True) -> dict[str, torch.Tensor]:
    """The full plain-model state from every tp rank's shards (collective: every tp rank calls it)."""
    size = dist.get_world_size(tp_group)
    full = {}
    for name, t in local_state.items():
        dim = tp_shard_dim(name, split_experts)
        if dim is None or size == 1:
            full[name] = t.detach().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
        full[name] = torch.cat(parts, dim)
    return full


def validate_tensor_parallel(cfg: ModelConfig, tp: int, field: str = "layout.tp") -> None:
    """Refuse a tp degree that does not divide every dim it splits (callable before any group exists)."""
    raise_problem(tensor_parallel_problem(cfg, tp, field))


# --- the tensor-parallel modules ------------------------------------------------------------------------

class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + vocab / tp) of the embedding; tokens outside look up zeros, and the
    partial sums are all-reduced (reduce-scattered along the sequence under SP)."""

    tp_group: ProcessGroup
    sequence_parallel: bool
    vocab_start: int

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.tp_group, self.sequence_parallel)


def row_linear_out(module: nn.Module, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The row-parallel `linear` of a tp `module` on `x` and the region's exit (g, or the sequence reduce-scatter),
    fused and overlapped (`tensor_comm.linear_scatter`) under `layout.tp_comm_overlap` where nothing else claims the
    weight's gradient (a pipeline's W pass) and there is no bias."""
    if (module.tp_comm_overlap and module.fused_matmuls and getattr(module, "weight_grad_queue", None) is None
            and linear.bias is None):
        return linear_scatter(x, module.tp_group, linear.weight, module.collective_store)
    return exit_tp_region(linear(x), module.tp_group, module.sequence_parallel)


class TensorParallelAttention(Attention):
    """Local query and kv heads: f (or the sequence all-gather) in, g (or the reduce-scatter) out."""

    tp_group: ProcessGroup
    sequence_parallel: bool
    tp_comm_overlap: bool = False  # `layout.tp_comm_overlap`: see `tensor_comm.gather_linears`
    collective_store: CollectiveStore | None = None  # set by selective recompute around a block's forward
    # false where the linears are modules of their own (float8): the input is gathered and goes through them
    fused_matmuls: bool = True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        if not self.sequence_parallel:
            x = copy_to_tp(x, self.tp_group)
        return super().forward(x, cos, sin, mask)  # `project_out` leaves the region

    def project_out(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear_out(self, self.o_proj, x)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.sequence_parallel:
            return super().project_qkv(x)
        if not self.fused_matmuls:
            return super().project_qkv(gather_sequence(x, self.tp_group).contiguous())
        linears = (self.q_proj, self.k_proj, self.v_proj)
        out = gather_linears(x, self.tp_group, *(m.weight for m in linears),
                             weight_grad_queue=getattr(self, "weight_grad_queue", None),
                             overlap=self.tp_comm_overlap, store=self.collective_store)
        return tuple(y if m.bias is None else y + m.bias for y, m in zip(out, linears, strict=True))


class TensorParallelMLP(MLP):
    """A 1/tp slice of the ffn dim: f (or the sequence all-gather) in, g (or the reduce-scatter) out."""

    tp_group: ProcessGroup
    sequence_parallel: bool
    tp_comm_overlap: bool = False  # `layout.tp_comm_overlap`: see `tensor_comm.gather_linears`
    collective_store: CollectiveStore | None = None  # set by selective recompute around a block's forward
    # false where the linears are modules of their own (float8): the input is gathered and goes through them
    fused_matmuls: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            x = copy_to_tp(x, self.tp_group)
        return super().forward(x)  # `project_down` leaves the region

    def project_down(self, h: torch.Tensor) -> torch.Tensor:
        return row_linear_out(self, self.down_proj, h)

    def project_gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.sequence_parallel:
            return super().project_gate_up(x)
        if not self.fused_matmuls:
            return super().project_gate_up(gather_sequence(x, self.tp_group).contiguous())
        return gather_linears(x, self.tp_group, self.gate_proj.weight, self.up_proj.weight,
                              weight_grad_queue=getattr(self, "weight_grad_queue", None),
                              overlap=self.tp_comm_overlap, store=self.collective_store)


class TensorParallelMoE(MoE):
    """Every expert (and the shared expert) holds a 1/tp slice of its ffn dim; routing is replicated over
    the whole gathered sequence. One f/g pair (or gather/reduce-scatter) for routed and shared experts."""

    tp_group: ProcessGroup
    sequence_parallel: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.tp_group
        x = enter_tp_region(x, group, self.sequence_parallel)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.route(grad_on_first_rank(x, group), shape[0])
        # the weights scale partial expert outputs, so their gradient is partial too: f sums it
        out, shared = self.dispatch_combine(x, experts, copy_to_tp(weights, group), rows=shape[0],
                                            beside=self.shared_beside(x))
        out = out if shared is None else out + shared
        return exit_tp_region(out.view(shape), group, self.sequence_parallel)

    def shared_gate_weight(self) -> torch.Tensor:
        # the gate (replicated) scales each rank's partial shared-expert output, so its weight's gradient is partial
        # too: the weight enters through f, whose backward sums it over tp (the input's share is summed by the
        # region's own f)
        return copy_to_tp(self.shared_gate.weight, self.tp_group)


class TokenSplitMoE(TensorParallelMoE):
    """Whole routed experts under tp (`layout.etp = 1`): each tp rank routes and dispatches its own 1/tp of every
    sequence (its sequence-parallel slice; without SP the same slice of the replicated input), so each token
    travels to its experts once per tp group, and the expert outputs come back whole. The shared experts are
    split over tp like a dense MLP (f or the all-gather in, g or the reduce-scatter out).

    Gradients. The router sees only the rank's tokens, so its weight enters through f (`TokenSplitRouter`). The
    experts' weights are whole and their gradients partial per tp rank: the tp ranks reduce them with the edp
    ranks (`fivefold.parallel.mesh.expert_groups`). The routing statistics that span the micro-batch are summed
    over tp by `split_routing_over_tp` (tp the outer split, context parallel's inside it); the
    z-loss, a mean over the rank's tokens, is averaged over tp. Without SP the routed outputs are all-gathered
    along the sequence, whose backward keeps the rank's part of the (replicated) gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, sp = self.tp_group, self.sequence_parallel
        full = enter_tp_region(x, group, sp) if self.shared is not None or not sp else None
        local = x if sp else own_sequence_part(full, group)
        rows = local.shape[0]
        flat = local.reshape(-1, local.shape[-1])
        experts, weights = self.route(flat, rows)
        # the shared experts' matmuls (no collective) run beside the dispatch; their g / reduce-scatter after it
        beside = None if full is None else self.shared_beside(full.reshape(-1, full.shape[-1]))
        out, shared = self.dispatch_combine(flat, experts, weights, rows=rows, beside=beside)
        out = out.view(local.shape)
        if shared is not None:
            shared = exit_tp_region(shared.view(full.shape), group, sp)
        if not sp:
            out = gather_sequence_parts(out, group)
        return out if shared is None else out + shared

    def route(self, x: torch.Tensor, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        experts, weights = super().route(x, rows)
        if self.z_loss is not None:  # a mean over this rank's tokens: the micro-batch's is the mean over tp
            self.z_loss = reduce_from_tp(self.z_loss, self.tp_group) / dist.get_world_size(self.tp_group)
        return experts, weights


class TokenSplitRouter(nn.Linear):
    """The router of a token-split MoE layer: it sees the rank's tokens only, so its weight's gradient is partial and
    the weight enters through f (summed over tp). A module of its own, so that the weight it reads is the one that
    ZeRO-3's unit has gathered before its forward."""

    tp_group: ProcessGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, copy_to_tp(self.weight, self.tp_group))


class TokenSplitLoadBalancing:
    """Replacement of a token-split MoE layer's `load_balancing_loss`: its slot counts and score sums are summed
    over tp (forward all-reduce; backward the rank's own gradient, since every tp rank holds the same loss, as it
    holds the same language-model loss), then passed on to the next split (context parallel's, or the plain loss)."""

    def __init__(self, inner, group: ProcessGroup) -> None:
        self.inner, self.group = inner, group

    def __call__(self, slot_counts: torch.Tensor, prob_sums: torch.Tensor, tokens: int) -> torch.Tensor:
        both = reduce_from_tp(torch.cat([slot_counts, prob_sums], -1), self.group)
        counts, sums = both.split(slot_counts.shape[-1], -1)
        return self.inner(counts, sums, tokens * dist.get_world_size(self.group))


class TokenSplitExpertSlots:
    """Replacement of a token-split MoE layer's `expert_slots` for capacity-based routing: the expert choices of
    the tp ranks' parts are all-gathered along the sequence, the next split (context parallel's, or the plain
    count) gives the queue positions of the whole, and the rank keeps its part's."""

    def __init__(self, inner, group: ProcessGroup, top_k: int) -> None:
        self.inner, self.group, self.top_k = inner, group, top_k

    def __call__(self, flat_expert: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
        part = flat_expert.view(rows, -1, self.top_k)
        whole = all_gather(part, 1, self.group)
        slot, capacity = self.inner(whole.reshape(-1), rows)
        own = slot.view(whole.shape).chunk(dist.get_world_size(self.group), 1)[dist.get_rank(self.group)]
        return own.reshape(-1), capacity


def split_routing_over_tp(moe: MoE, tp_group: ProcessGroup) -> None:
    """Make a token-split MoE layer's routing statistics span the tp ranks' parts (`TokenSplitLoadBalancing`, and
    `TokenSplitExpertSlots` for capacity-based routing), in place. Context parallel, applied later, installs its
    own as their `inner` (`fivefold.parallel.context.install_inner`): tp is the outer split, gathered first."""
    moe.load_balancing_loss = TokenSplitLoadBalancing(moe.load_balancing_loss, tp_group)
    if moe.capacity_factor > 0:
        moe.expert_slots = TokenSplitExpertSlots(moe.expert_slots, tp_group, moe.top_k)


class SequenceParallelRMSNorm(RMSNorm):
    """A norm on this rank's sequence slice. Its weight's gradient is then a partial sum over the slice, so
    the weight enters through f (backward all-reduce over tp): the gradient is full and identical on every
    rank, whatever object holds the parameter (a hook on the `nn.Parameter` would be lost to a wrapper that
    swaps it, such as `fully_shard`)."""

    tp_group: ProcessGroup
    sequence_parallel: bool

    def forward_weight(self) -> torch.Tensor:
        return copy_to_tp(self.weight, self.tp_group)


def _shard_param(module: nn.Module, attr: str, dim: int, tp_rank: int, tp_size: int) -> None:
    full = getattr(module, attr)
    setattr(module, attr, nn.Parameter(shard_for_rank(full.detach(), dim, tp_rank, tp_size).clone()))


def _shard_linear(linear: nn.Linear, dim: int, tp_rank: int, tp_size: int) -> None:
    _shard_param(linear, "weight", dim, tp_rank, tp_size)
    linear.out_features, linear.in_features = linear.weight.shape
    if linear.bias is not None:  # split with the output rows (column parallel); a row-parallel bias would be
        # added once after the reduction, and no such linear has one
        if dim != COLUMN:
            raise ValueError(f"a row-parallel linear with a bias ({linear}): tensor parallelism adds none")
        _shard_param(linear, "bias", 0, tp_rank, tp_size)


def _shard_mlp(mlp: MLP, tp_rank: int, tp_size: int) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        _shard_linear(getattr(mlp, name), tp_shard_dim(f"{name}.weight"), tp_rank, tp_size)


def _to_tp_class(module: nn.Module, cls: type, tp_group: ProcessGroup, sequence_parallel: bool) -> None:
    module.__class__ = cls
    module.tp_group, module.sequence_parallel = tp_group, sequence_parallel


def apply_tensor_parallel(model: Llama, tp_group: ProcessGroup, sequence_parallel: bool,
                          split_experts: bool = True, comm_overlap: bool = False) -> None:
    """Shard `model` in place over `tp_group` (see the module docstring). The model must hold the same
    full weights on every tp rank (built from the same seed) and have no optimizer yet. The routed experts stay
    whole (`TokenSplitMoE`) unless `split_experts` (`layout.etp = layout.tp`). `comm_overlap`
    (`layout.tp_comm_overlap`, with sequence parallel): the gathered linears' backward overlaps its collectives."""
    tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    validate_tensor_parallel(model.cfg, tp_size)
    if tp_size == 1:
        return
    if any(isinstance(m, TensorParallelAttention | VocabParallelEmbedding) for m in model.modules()):
        raise ValueError("tensor parallelism is already applied to this model")
    overlap = comm_overlap and sequence_parallel  # only the gathered linears of sequence parallel overlap
    for block in model.layers.values():
        attn = block.attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _shard_linear(getattr(attn, name), tp_shard_dim(f"{name}.weight"), tp_rank, tp_size)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp_size, attn.n_kv_heads // tp_size
        _to_tp_class(attn, TensorParallelAttention, tp_group, sequence_parallel)
        attn.tp_comm_overlap = overlap
        mlp = block.mlp
        if isinstance(mlp, MoE):
            if split_experts:
                for name in EXPERT_WEIGHTS:
                    _shard_param(mlp, name, tp_shard_dim(name), tp_rank, tp_size)
            if mlp.shared is not None:
                _shard_mlp(mlp.shared, tp_rank, tp_size)
            _to_tp_class(mlp, TensorParallelMoE if split_experts else TokenSplitMoE, tp_group, sequence_parallel)
            if not split_experts:
                split_routing_over_tp(mlp, tp_group)
                mlp.router.__class__, mlp.router.tp_group = TokenSplitRouter, tp_group
        else:
            _shard_mlp(mlp, tp_rank, tp_size)
            _to_tp_class(mlp, TensorParallelMLP, tp_group, sequence_parallel)
            mlp.tp_comm_overlap = overlap
    tied = model.cfg.tied_embeddings and model.embed is not None and model.lm_head is not None
    if model.embed is not None:
        embed = model.embed
        _shard_param(embed, "weight", 0, tp_rank, tp_size)
        embed.num_embeddings = embed.weight.shape[0]
        _to_tp_class(embed, VocabParallelEmbedding, tp_group, sequence_parallel)
        embed.vocab_start = tp_rank * embed.num_embeddings
    if model.lm_head is not None:
        if tied:
            model.lm_head.weight = model.embed.weight
            model.lm_head.out_features = model.embed.num_embeddings
        else:
            _shard_linear(model.lm_head, 0, tp_rank, tp_size)
    for name, module in model.named_modules():
        # per-head query/key norms see this rank's heads only, so their weight's gradient is partial like a
        # sequence-parallel norm's: both enter through f
        if isinstance(module, RMSNorm) and (sequence_parallel or name.endswith(("q_norm", "k_norm"))):
            _to_tp_class(module, SequenceParallelRMSNorm, tp_group, sequence_parallel)


def vocab_parallel_loss_sum(model: Llama, hidden: torch.Tensor, targets: torch.Tensor, tp_group: ProcessGroup,
                            sequence_parallel: bool, chunk_tokens: int = TP_LOSS_CHUNK_TOKENS,
                            compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Summed token cross-entropy of this rank's rows `targets` [batch, seq] (-100 ignored) from the final
    hidden states (sequence-sharded under SP), with the local vocab shard of `model.lm_head`; the full
    logits are never gathered and fp32 logits exist for `chunk_tokens` tokens at a time. Same value on
    every tp rank."""
    hidden = gather_sequence(hidden, tp_group) if sequence_parallel else copy_to_tp(hidden, tp_group)
    weight = model.lm_head.weight
    vocab_start = dist.get_rank(tp_group) * weight.shape[0]
    return vocab_parallel_cross_entropy_sum(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                            vocab_start, tp_group, chunk_tokens, compute_dtype or hidden.dtype)

