"""A Llama-family decoder in plain PyTorch: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU or mixture-of-experts MLP. It holds no parallel code: the parallel engine wraps or replaces
its modules from outside (see `fivefold.parallel`).

Blocks live in a `ModuleDict` keyed by their layer index and the embedding, final norm and output
layer may be `None`, so that a pipeline stage is this same class with some parts removed.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ConfigError, ModelConfig, shown
from fivefold.models.masking import DocumentMask, band_mask, document_attention


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs matmuls in on `x`'s device, or `x`'s own where autocast is off. Autocast does not
    reach into a custom autograd function's backward: its forward fixes the dtype with this and keeps it."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class RMSNormFunction(torch.autograd.Function):
    """weight * (x / rms(x)), the division in fp32 whatever x's dtype (as Llama does), saving for backward only
    what it needs: its input x (in x's dtype) and the reciprocal RMS (fp32, one per token). Autograd over the
    composed ops would also keep the fp32 copy of x and the normalised x, 3 (bf16) or 2 (fp32) more bytes per
    element; backward recomputes the normalised x from x and 1/rms instead (element-wise, cheap)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        # in the wider of the two dtypes, but in the weight's when an fp32 residual stream meets bf16 weights (the
        # blocks compute in bf16: their input is cast once, here)
        out = weight * (xf * rstd).to(x.dtype)
        return out.to(weight.dtype) if weight.dtype == torch.bfloat16 else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_normed = (grad * weight).to(x.dtype).float()
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.forward_weight(), self.eps)

    def forward_weight(self) -> torch.Tensor:
        """The weight as the forward uses it (sequence parallel passes it through a tp collective)."""
        return self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s:
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [*positions.shape, head_dim] (halves repeated, rotate-half layout)."""
    inv_freq = rope_frequencies(cfg).to(positions.device)
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape [batch, heads, seq, head_dim] by position (cos, sin: [seq, head_dim], or [batch, 1, seq,
    head_dim] for per-row positions)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention through `scaled_dot_product_attention`; within documents and a sliding
    window when a `DocumentMask` is given (`fivefold.models.masking`).

    `n_heads` and `n_kv_heads` are the heads this module computes: the tensor-parallel engine
    divides them by tp when it shards the projections.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else cfg.n_heads * cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else cfg.n_kv_heads * cfg.head_dim, cfg.norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [batch, heads, seq, head_dim] of `x` [batch, seq, hidden], the queries and keys normalised by
        `model.qk_norm` (before the rotary embedding)."""
        q, k, v = self.project_qkv(x)
        b, s, _ = q.shape
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None) -> torch.Tensor:
        q, k, v = self.heads(x)
        b, s = x.shape[0], q.shape[2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, mask)
        return self.project_out(out.transpose(1, 2).reshape(b, s, -1))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: list[torch.Tensor]) -> torch.Tensor:
        """Inference on new tokens `x` [batch, new, hidden] whose positions follow the cached ones: their keys and
        values are appended to `cache` ([k, v] of [batch, kv_heads, past, head_dim], empty at first)."""
        q, k, v = self.heads(x)
        b, s = x.shape[0], q.shape[2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        past = k.shape[2] - s
        # new token i sees the cached keys and the new ones up to itself (the last `window` of them)
        mask = None
        if s > 1 or self.window is not None and self.window < k.shape[2]:
            mask = band_mask(past, past + s, 0, k.shape[2] if self.window is None else self.window, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k, v projections [batch, seq, heads * head_dim]; tensor parallelism fuses their input."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_out(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads [batch, seq, heads * head_dim]; tensor parallelism fuses its output."""
        return self.o_proj(x)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None) -> (
        torch.Tensor
    ):
        """The attention kernel on [batch, heads, seq, head_dim]; recompute and context parallel wrap this."""
        if mask is not None:
            return document_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_gate_up(x)
        return self.project_down(F.silu(gate) * up)

    def project_gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up projections; tensor parallelism fuses their input."""
        return self.gate_proj(x), self.up_proj(x)

    def project_down(self, h: torch.Tensor) -> torch.Tensor:
        """The down projection; tensor parallelism fuses its output."""
        return self.down_proj(h)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts held as one batched weight, plus optional shared experts.

    Two implementations of the routed experts (`model.moe_impl`):

    - "grouped" (the default): the routed slots are sorted by expert on the device (a stable argsort of the expert
      indices; the per-expert counts stay on the device), the experts run as one grouped matmul over the sorted
      rows (`torch.nn.functional.grouped_mm` where it runs for the device and dtype, see `grouped_mm_runs`; else
      a loop over the experts that reads their offsets on the host once), and the outputs are scattered back to
      their tokens by `index_add_`. No padding and, with `grouped_mm`, no host read: the forward and backward of
      a layer never wait for the device.
    - "padded" (the earlier prototype, kept for comparison): tokens are packed into an [experts, capacity, hidden]
      tensor, capacity sized by a host read of the busiest expert's count, and run as one batched matmul.

    Dropless routing keeps every slot. Capacity-based routing (`capacity_factor > 0`) gives each expert
    `capacity_factor * tokens * top_k / experts` places in token order and drops the overflow (counted in
    `drop_fraction`); the grouped implementation still computes the dropped slots and weighs them by zero, so
    that the shapes never depend on the drops. The Switch-Transformer load-balancing loss is kept in `aux_loss`
    after each forward.
    """

    # `fivefold train --only-rank` only (`force_balanced_routing`): every expert gets the same number of slots
    balanced_routing = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, f, e = cfg.hidden, cfg.expert_ffn, cfg.n_experts
        self.n_experts, self.top_k, self.capacity_factor = e, cfg.top_k, cfg.capacity_factor
        self.impl = cfg.moe_impl
        self.router_scores, self.norm_topk, self.aux_loss_kind = cfg.router_scores, cfg.norm_topk, cfg.aux_loss
        self.router_z_loss_coef, self.bias_update_rate = cfg.router_z_loss_coef, cfg.bias_update_rate
        self.init_std = cfg.init_std
        self.router = nn.Linear(h, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, h, f))
        self.w_up = nn.Parameter(torch.empty(e, h, f))
        self.w_down = nn.Parameter(torch.empty(e, f, h))
        self.shared = MLP(h, f * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if cfg.shared_expert_gate else None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.drop_fraction: torch.Tensor | None = None
        if cfg.bias_update_rate > 0:  # the balancing bias (not a parameter: no gradient; checkpoints keep it,
            # `Engine.balancing_biases`) and the step's loads
            self.register_buffer("expert_bias", torch.zeros(e), persistent=False)
            self.register_buffer("expert_load", torch.zeros(e, dtype=torch.int64), persistent=False)
        # host-read count tables of an expert-parallel dispatch, kept by a recomputed forward for its recomputation
        # (`fivefold.parallel.recompute`): appended to while recording, taken from while replaying
        self.recorded_counts: list | None = None
        self.replayed_counts: list | None = None

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, std=self.init_std)
        for buffer in self.buffers():
            buffer.zero_()

    def route(self, x: torch.Tensor, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert indices and their weights for tokens `x` [tokens, hidden] of `rows` sequences (by
        `model.router_scores` and `norm_topk`, chosen with the balancing bias when `bias_update_rate > 0`);
        records the load-balancing loss (`aux_loss`), the router z-loss (`z_loss`) and the step's expert loads."""
        logits = self.router(x).float()
        scores = F.softmax(logits, dim=-1) if self.router_scores == "softmax" else torch.sigmoid(logits)
        if self.balanced_routing:
            experts = balanced_experts(x.shape[0], self.top_k, self.n_experts, x.device)
        else:  # the bias only chooses: the weights are the scores themselves
            choice = scores + self.expert_bias if self.bias_update_rate > 0 else scores
            experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        # per expert (and per sequence for the sequence-wise loss, which alone needs them): routed slots and the
        # sums of the scores normalised over the experts
        rows = rows if self.aux_loss_kind == "sequence" else 1
        row_of_slot = torch.arange(x.shape[0], device=x.device).div(x.shape[0] // rows, rounding_mode="floor")
        slot_counts = expert_counts((row_of_slot.unsqueeze(1) * self.n_experts + experts).reshape(-1),
                                    rows * self.n_experts).view(rows, self.n_experts)
        probs = scores if self.router_scores == "softmax" else scores / scores.sum(-1, keepdim=True)
        self.aux_loss = self.load_balancing_loss(slot_counts.float(), probs.view(rows, -1, self.n_experts).sum(1),
                                                 x.shape[0])
        self.z_loss = torch.logsumexp(logits, dim=-1).square().mean() if self.router_z_loss_coef > 0 else None
        if self.bias_update_rate > 0 and torch.is_grad_enabled() and self.replayed_counts is None:
            self.expert_load += slot_counts.sum(0)  # training forwards only, once (not again when recomputed)
        return experts, weights.to(x.dtype)

    def load_balancing_loss(self, slot_counts: torch.Tensor, prob_sums: torch.Tensor, tokens: int) -> torch.Tensor:
        """The load-balancing loss over `tokens` tokens of `rows` sequences, from the routed slot counts and the
        normalised score sums per sequence and expert ([rows, experts] each). Switch: E * sum_e (fraction of the
        routed slots that went to e) * (mean score of e), over all the tokens; sequence-wise: the same within each
        sequence, averaged over the sequences. Context parallel replaces this method to sum the statistics over
        the micro-batch's cp ranks first."""
        if self.aux_loss_kind == "switch":
            slot_counts, prob_sums = slot_counts.sum(0, keepdim=True), prob_sums.sum(0, keepdim=True)
        row_tokens = tokens / slot_counts.shape[0]
        per_row = (slot_counts / (row_tokens * self.top_k) * (prob_sums / row_tokens)).sum(-1)
        return self.n_experts * per_row.mean()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Move the balancing bias towards the mean load by `bias_update_rate` (DeepSeek-V3's auxiliary-loss-free
        balancing) from the expert loads `load` of a step, and start counting the next step's."""
        self.expert_bias += self.bias_update_rate * torch.sign(load.float().mean() - load.float())
        self.expert_load.zero_()

    def expert_slots(self, flat_expert: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
        """(position of each routed slot in its expert's queue, capacity) for the slots `flat_expert` [tokens *
        top_k] of `rows` sequences in token order: earlier tokens come first, so capacity-based routing drops
        the last tokens that chose an over-full expert. Context parallel replaces this method to count
        positions over the whole sequence."""
        n_experts = self.n_experts
        counts = expert_counts(flat_expert, n_experts)
        order = flat_expert.argsort(stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(flat_expert)
        slot[order] = torch.arange(order.numel(), device=flat_expert.device) - starts[flat_expert[order]]
        if self.capacity_factor > 0:
            tokens = flat_expert.numel() // self.top_k
            return slot, max(1, math.ceil(self.capacity_factor * tokens * self.top_k / n_experts))
        return slot, int(counts.max())  # dropless: one host sync for the packed shape

    def experts_forward(self, packed: torch.Tensor) -> torch.Tensor:
        """All experts on their packed tokens: [experts, capacity, hidden] -> same shape."""
        hidden = F.silu(torch.bmm(packed, self.w_gate)) * torch.bmm(packed, self.w_up)
        return torch.bmm(hidden, self.w_down)

    def grouped_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts on `rows` [slots, hidden] sorted by expert, `counts[e]` (on the device) of them for expert e
        -> [slots, hidden]. In autocast's dtype when it is on (as the batched matmuls would be)."""
        device_type = rows.device.type
        dtype = autocast_dtype(rows)
        rows = rows.to(dtype)
        w_gate, w_up, w_down = (w.to(dtype) for w in (self.w_gate, self.w_up, self.w_down))
        if grouped_mm_runs(device_type, dtype, w_gate.shape[1], w_gate.shape[2]):
            ends = torch.cumsum(counts, 0, dtype=torch.int32)  # grouped_mm's offsets: the end row of each group
            hidden = F.silu(F.grouped_mm(rows, w_gate, offs=ends)) * F.grouped_mm(rows, w_up, offs=ends)
            return F.grouped_mm(hidden, w_down, offs=ends)
        # without grouped_mm: one matmul per expert on its slice, the slice bounds read on the host once
        bounds = [0, *torch.cumsum(counts, 0).tolist()]
        outs = []
        for e in range(counts.numel()):
            part = rows[bounds[e]:bounds[e + 1]]
            outs.append((F.silu(part @ w_gate[e]) * (part @ w_up[e])) @ w_down[e])
        return torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.route(x, shape[0])
        out, shared = self.dispatch_combine(x, experts, weights, rows=shape[0], beside=self.shared_beside(x))
        return (out if shared is None else out + shared).view(shape)

    def shared_beside(self, x: torch.Tensor):
        """The shared experts on tokens `x` as a callable for `dispatch_combine` to run beside the dispatch (None
        without shared experts)."""
        return None if self.shared is None else functools.partial(self.shared_output, x)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts on tokens `x` [tokens, hidden], scaled by their sigmoid gate when there is one."""
        out = self.shared(x)
        if self.shared_gate is None:
            return out
        return out * torch.sigmoid(F.linear(x, self.shared_gate_weight()))

    def shared_gate_weight(self) -> torch.Tensor:
        """The shared experts' gate weight as the forward uses it (tensor parallelism replaces this)."""
        return self.shared_gate.weight

    def kept_slots(self, experts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(indices of the routed slots that fit their expert's capacity, in token order; their queue
        positions; the capacity); records `drop_fraction`."""
        slot, capacity = self.expert_slots(experts.reshape(-1), rows)
        keep = slot < capacity
        self.drop_fraction = 1.0 - keep.float().mean()
        kept = keep.nonzero().squeeze(1)  # slot index = token * top_k + choice
        return kept, slot[kept], capacity

    def kept_mask(self, flat_expert: torch.Tensor, rows: int) -> torch.Tensor | None:
        """Which routed slots fit their expert's capacity (None when routing is dropless), without reading
        anything on the host; records `drop_fraction`."""
        if self.capacity_factor <= 0:
            self.drop_fraction = flat_expert.new_zeros((), dtype=torch.float32)
            return None
        slot, capacity = self.expert_slots(flat_expert, rows)
        keep = slot < capacity
        self.drop_fraction = 1.0 - keep.float().mean()
        return keep

    def dispatch_combine(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, rows: int = 1,
                         beside=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the routed experts on the tokens of `x` [tokens, hidden] and sum each token's expert outputs scaled
        by its routing weights, by `model.moe_impl`; returns that and the result of `beside()` (the shared experts,
        or None). Expert parallel replaces this method with a dispatch over the ep ranks, which runs `beside` while
        the tokens travel; here it runs first."""
        shared = beside() if beside is not None else None
        return self.local_dispatch_combine(x, experts, weights, rows), shared

    def local_dispatch_combine(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                               rows: int = 1) -> torch.Tensor:
        """`dispatch_combine`'s routed experts on this rank, by `model.moe_impl`."""
        if self.impl == "padded":
            return self.padded_dispatch_combine(x, experts, weights, rows)
        flat = experts.reshape(-1)
        keep = self.kept_mask(flat, rows)
        order = flat.argsort(stable=True)  # slot index = token * top_k + choice, grouped by expert
        token = order // self.top_k
        out = self.grouped_experts(x[token], expert_counts(flat, self.n_experts))
        contrib = out.to(x.dtype) * weights.reshape(-1)[order].unsqueeze(-1)
        if keep is not None:  # dropped slots were computed, like the others, and count for nothing
            contrib = torch.where(keep[order].unsqueeze(-1), contrib, 0.0)
        return x.new_zeros(x.shape).index_add_(0, token, contrib)

    def padded_dispatch_combine(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                                rows: int = 1) -> torch.Tensor:
        """Pack the tokens of `x` [tokens, hidden] by expert into [experts, capacity, hidden], run the experts as
        one batched matmul, and sum each token's expert outputs scaled by its routing weights."""
        kept, slot, capacity = self.kept_slots(experts, rows)
        expert, src_token = experts.reshape(-1)[kept], kept // self.top_k
        packed = x.new_zeros(self.n_experts, capacity, x.shape[1])
        packed[expert, slot] = x[src_token]
        result = self.experts_forward(packed)
        contrib = result[expert, slot] * weights.reshape(-1)[kept].unsqueeze(-1)
        return x.new_zeros(x.shape).index_add_(0, src_token, contrib)


def expert_counts(flat_expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of the routed slots `flat_expert` went to each of the `n_experts` experts, on the device and without
    a host read (`torch.bincount` reads the largest index on the host on accelerators)."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat_expert.device)
    return counts.index_add_(0, flat_expert, torch.ones_like(flat_expert))


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype, hidden: int, ffn: int) -> bool:
    """Whether `torch.nn.functional.grouped_mm` exists in this PyTorch and runs for experts of this shape and dtype
    on this device type (tried once on two tiny groups, with and without an empty one). It is public from
    PyTorch 2.10; on accelerators its kernels take some dtypes only (bf16) and rows aligned to 16 bytes."""
    if not hasattr(F, "grouped_mm"):
        return False
    device = torch.device(device_type, torch.accelerator.current_device_index()) if device_type != "cpu" else "cpu"
    try:
        with torch.no_grad():
            rows = torch.zeros(4, hidden, dtype=dtype, device=device)
            weights = torch.zeros(2, hidden, ffn, dtype=dtype, device=device)
            for ends in ((2, 4), (0, 4)):
                F.grouped_mm(rows, weights, offs=torch.tensor(ends, dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def balanced_experts(tokens: int, top_k: int, n_experts: int, device: torch.device) -> torch.Tensor:
    """[tokens, top_k] expert indices that load every expert equally: slot s = token * top_k + choice goes to expert
    s mod n_experts (a token's top_k choices are distinct when top_k <= n_experts; the counts differ by at most one)."""
    return torch.arange(tokens * top_k, device=device).view(tokens, top_k) % n_experts


def force_balanced_routing(model: nn.Module) -> int:
    """Route every MoE layer of `model` by `balanced_experts` instead of the router's top-k (the router still runs
    and weighs the chosen experts). Only `fivefold train --only-rank` sets this: with stood-in ranks the activations
    mean nothing, and a balanced load is the one that every rank of a real run can plan for. Returns the layers
    changed."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.balanced_routing = True
    return len(layers)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg) if cfg.is_moe else MLP(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Decoder-only transformer. `forward(tokens)` returns logits; `forward_hidden` stops before the head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mlp != "swiglu":
            raise ConfigError(f"model.mlp = {shown(cfg.mlp)}: the engine builds SwiGLU MLPs only (other MLPs are for "
                              "`fivefold plan`)")
        self.cfg = cfg
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None,
                     regions: dict[str, tuple[tuple[int, int], ...]] | None = None) -> None:
        """Initialise every parameter (after `to_empty` from the meta device, or to re-seed) by the layout-free
        scheme of `draw_initial_values`, drawn on the parameter's device and only for the part it holds: each
        parameter's values depend only on (seed, plain name, index in the full tensor). `regions` maps a parameter
        name to the part of the full plain tensor that this module holds ((start, stop) per dim; a tensor- or
        expert-parallel shard, a pipeline stage's parameter, a ZeRO-3 slice, whose local tensor is `to_local()`); a
        name not in it holds the whole tensor. Without a seed one is drawn from the global generator."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        shapes = full_parameter_shapes(self.cfg)
        for name, param in self.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            region = (regions or {}).get(name)
            if local.numel() == 0:
                continue
            draw_initial_values(local, self.cfg, name, shapes[name], seed, region)  # on the parameter's device
        for buffer in self.buffers():  # the MoE balancing bias and expert loads start at zero
            buffer.zero_()

    def rope(self, seq_len: int, device: torch.device, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(offset, offset + seq_len, device=device)
        return rope_cos_sin(self.cfg, positions)

    def forward_hidden(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] (or hidden states on a later pipeline stage) -> final hidden states.

        `positions`: the rotary positions, [seq] (None: 0..seq-1) or, under document masking, the document
        positions [batch, seq] of `fivefold.models.masking.document_positions`."""
        if positions is None:
            # from the input, before the embedding: under sequence parallelism its output holds a slice
            positions = torch.arange(x.shape[1], device=x.device)
        mask = self.attention_mask(positions, x.shape[0])
        if self.embed is not None:
            x = self.embed(x)
            if self.cfg.fp32_residual:
                x = x.float()
        cos, sin = rope_cos_sin(self.cfg, positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if positions.dim() == 2:  # per-row positions: [batch, 1 (heads), seq, head_dim]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for block in self.layers.values():
            x = block(x, cos, sin, mask)
        if self.norm is not None:
            x = self.norm(x)
        return x

    def attention_mask(self, positions: torch.Tensor, rows: int) -> DocumentMask | None:
        """The mask every layer of this forward shares: None for plain causal attention (SDPA's causal kernel),
        else a `DocumentMask` of the document positions (one document per row under `attn_mask = "causal"`)."""
        if not self.cfg.masks_attention:
            return None
        if positions.dim() == 1:
            positions = positions.expand(rows, -1)
        # a sliding window over causal attention: one document per row, known without reading the positions
        whole = [[(0, positions.shape[1])]] * rows if self.cfg.attn_mask == "causal" else None
        return DocumentMask(positions, self.cfg.sliding_window, whole)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.forward_hidden(tokens, positions)
        return self.lm_head(x) if self.lm_head is not None else x

    def new_cache(self) -> list[list[torch.Tensor]]:
        """An empty key/value cache for `forward_cached`: one [k, v] pair per block, filled as tokens arrive."""
        return [[] for _ in self.layers]

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, cache: list[list[torch.Tensor]]) -> torch.Tensor:
        """Inference: logits [batch, new, vocab] of the new `tokens` [batch, new], which follow the tokens already
        in `cache` (from `new_cache`); their keys and values are added to it. A whole model only (not a stage)."""
        past = cache[0][0].shape[2] if cache and cache[0] else 0
        x = self.embed(tokens)
        if self.cfg.fp32_residual:
            x = x.float()
        cos, sin = rope_cos_sin(self.cfg, torch.arange(past, past + tokens.shape[1], device=tokens.device))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block, layer_cache in zip(self.layers.values(), cache, strict=True):
            x = block.forward_cached(x, cos, sin, layer_cache)
        return self.lm_head(self.norm(x))

    def moe_drop_fraction(self) -> torch.Tensor | None:
        """Mean over the MoE layers of the fraction of routed slots dropped by capacity in the last forward."""
        drops = [b.mlp.drop_fraction for b in self.layers.values()
                 if isinstance(b.mlp, MoE) and b.mlp.drop_fraction is not None]
        return torch.stack(drops).mean() if drops else None

    def moe_router_loss(self) -> torch.Tensor | None:
        """The MoE layers' router losses from the last forward, weighted: `aux_loss_coef` times the summed
        load-balancing losses plus `router_z_loss_coef` times the summed z-losses (None for dense models)."""
        aux = self.moe_aux_loss()
        if aux is None:
            return None
        z_losses = [b.mlp.z_loss for b in self.layers.values() if isinstance(b.mlp, MoE) and b.mlp.z_loss is not None]
        loss = self.cfg.aux_loss_coef * aux
        return loss + self.cfg.router_z_loss_coef * torch.stack(z_losses).sum() if z_losses else loss

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE layers' load-balancing losses from the last forward (None for dense models)."""
        losses = [b.mlp.aux_loss for b in self.layers.values() if isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


# A parameter's tiles, each drawn from a generator of its own: the values depend on the full shape only, never on the
# layout, and a rank draws the tiles that its region meets (columns of about 1024 by rows of about 256).
INIT_TILE_ELEMENTS = 1 << 18
INIT_TILE_COLUMNS = 1024


def full_parameter_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The shape of every parameter of the whole plain model by plain name (tied weights under both names)."""
    with torch.device("meta"):
        model = Llama(cfg)
    return {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}


def init_rule(cfg: ModelConfig, name: str) -> tuple[str, float]:
    """(the name whose values parameter `name` takes, its std; 0.0 for the norms' ones). Residual-branch outputs
    (o_proj, down_proj) are scaled down with depth, as in GPT-2; a tied output layer is the embedding."""
    if cfg.tied_embeddings and name == "lm_head.weight":
        name = "embed.weight"
    if name.endswith("norm.weight"):
        return name, 0.0
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return name, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return name, cfg.init_std


def init_tile(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The tile of a parameter of full shape `shape`: up to INIT_TILE_COLUMNS of the last dim by as many of the
    dim before as make about INIT_TILE_ELEMENTS, one index of each dim before those (one expert of a batched expert
    weight); runs of INIT_TILE_ELEMENTS of a 1-D tensor."""
    if len(shape) <= 1:
        return tuple(min(n, INIT_TILE_ELEMENTS) for n in shape)
    columns = min(shape[-1], INIT_TILE_COLUMNS)
    rows = min(shape[-2], max(1, INIT_TILE_ELEMENTS // columns))
    return (1,) * (len(shape) - 2) + (rows, columns)


def tile_seed(seed: int, name: str, tile: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{'.'.join(map(str, tile))}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def draw_initial_values(out: torch.Tensor, cfg: ModelConfig, name: str, shape: torch.Size | tuple[int, ...],
                        seed: int, region: tuple[tuple[int, int], ...] | None = None) -> int:
    """Write full[region] of the initial value of plain parameter `name` (full shape `shape`) into `out` (the
    region's shape, any dtype), drawing on `out`'s device; returns the number of values drawn.

    The full tensor is cut into tiles (`init_tile`); tile i is `normal_(0, std)` from a generator on the device
    seeded with (seed, name, i). So any region is exact whatever the layout, and only the tiles that the region
    meets are drawn, one at a time: a tensor-parallel column slice draws its columns' tiles, not whole rows. The
    values depend on the device's generator (a CPU run and an accelerator run draw different weights, as may two
    kinds of accelerator; every layout on one kind of device draws the same)."""
    region = tuple(region) if region is not None else tuple((0, n) for n in shape)
    source, std = init_rule(cfg, name)
    if name.endswith(".bias"):  # biases (of q, k, v under model.qkv_bias) start at zero
        out.zero_()
        return 0
    if std == 0.0:
        out.fill_(1.0)
        return 0
    tile = init_tile(shape)
    generator = torch.Generator(device=out.device)
    drawn = 0
    for index in itertools.product(*(range(a // t, -(-b // t)) for (a, b), t in zip(region, tile, strict=True))):
        lo = [i * t for i, t in zip(index, tile, strict=True)]
        hi = [min(start + t, n) for start, t, n in zip(lo, tile, shape, strict=True)]
        generator.manual_seed(tile_seed(seed, source, index))
        values = torch.empty([b - a for a, b in zip(lo, hi, strict=True)], device=out.device)
        values.normal_(0.0, std, generator=generator)
        keep = [(max(a, r0), min(b, r1)) for a, b, (r0, r1) in zip(lo, hi, region, strict=True)]
        out[tuple(slice(k0 - r0, k1 - r0) for (k0, k1), (r0, _) in zip(keep, region, strict=True))] = values[
            tuple(slice(k0 - a, k1 - a) for (k0, k1), a in zip(keep, lo, strict=True))]
        drawn += values.numel()
    return drawn


def initial_values(cfg: ModelConfig, name: str, shape: torch.Size | tuple[int, ...], seed: int,
                   region: tuple[tuple[int, int], ...] | None = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """full[region] (fp32, on `device`) of the initial value of plain parameter `name` whose full shape is `shape`
    (`draw_initial_values`)."""
    region = tuple(region) if region is not None else tuple((0, n) for n in shape)
    out = torch.empty([b - a for a, b in region], device=device)
    draw_initial_values(out, cfg, name, shape, seed, region)
    return out


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int | None = None) -> Llama:
    """Build on the meta device (no memory), then materialise on `device` and initialise.

    With `device="meta"` the model stays a description: shapes and parameter counts only. The parallel engines
    keep it on the meta device, shard it, and materialise only each rank's part (`materialize` with regions):
    the initial values are the same whatever the layout (`draw_initial_values`).
    """
    with torch.device("meta"):
        model = Llama(cfg)
    if str(device) == "meta":
        return model
    materialize(model, device, seed)
    return model


def materialize(model: Llama, device: torch.device | str, seed: int | None,
                regions: dict[str, tuple[tuple[int, int], ...]] | None = None, root: nn.Module | None = None) -> None:
    """Allocate `model`'s (meta) parameters on `device` (from `root`, a module that holds it, when given) and
    initialise them (`Llama.init_weights`); a tied output layer held with its embedding stays one parameter."""
    (root or model).to_empty(device=device)
    tied = model.cfg.tied_embeddings and model.embed is not None and model.lm_head is not None
    if tied and model.lm_head.weight is not model.embed.weight:
        model.lm_head.weight = model.embed.weight
    model.init_weights(seed, regions)
