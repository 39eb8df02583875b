"""Bytes per rank of a layout, as the engine allocates them.

Model states (parameters, gradients, optimizer states, the fp32 accumulation buffer) are exact closed forms of
the model's parameter shapes, sharded by tensor parallel (projections, experts' MLPs, the vocabulary), expert
parallel (whole experts) and ZeRO (a flat shard over the data-parallel x context-parallel ranks that reduce
the gradients; expert weights over those ranks divided by ep, the edp ranks that hold the same experts: ZeRO-3
too, whose experts are `fully_shard` units over edp).

Activations are what autograd saves for backward, counted tensor by tensor as fivefold's Llama block saves
them (checked against `torch.autograd.graph.saved_tensors_hooks` on the real model in tests/test_planner_memory.py):

* RMSNorm saves its input and the reciprocal RMS (`models.llama.RMSNormFunction`; frameworks whose norm also
  keeps the normalised input set `norm_saves_normalized`);
* a linear saves its input: once per tensor in fp32, but once per linear under bf16 autocast (autocast
  casts the fp32 norm output separately for q, k and v, and for gate and up);
* rotary embedding saves nothing per token beyond the cos/sin tables (once per micro-batch);
* the attention kernel saves q, k, v, its output (also the output projection's input) and the log-sum-exp;
* under selective recompute a block keeps only its input and the outputs of its weight matmuls and of the
  attention kernel (q, k, v, attention output and log-sum-exp, o, gate, up, down; for MoE the router logits and
  the shared experts'), see `parallel/recompute.py`; another framework's policy keeps the matmul outputs its
  `selective_saved_matmuls` names (torchtitan's op-level policy: every other mm);
* SwiGLU saves gate and up outputs, the SiLU output and the product (a GELU MLP: up's output and GELU's);
* the fused output layer + cross-entropy saves the gradient of the hidden states and of the output weight
  (computed in forward).

Then the peak adds the micro-batches in flight of the pipeline schedule (simulated), the bf16 weight copies
that autocast keeps per micro-batch in flight, the loss temporaries of one chunk (or of the whole batch, at the
framework's `loss_peak_bytes` per logit), ZeRO-3's gathered blocks
and prefetch (under pp: the rank's whole stages gathered and their gradients unsharded for the step, the experts
too when edp > 1),
communication buckets and a fixed per-device overhead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fivefold.config import ConfigError, ModelConfig, shown
from fivefold.flops import balanced_stage_layers
from fivefold.parallel.schedules import SPLIT_BACKWARD
from fivefold.planner.layout import Framework, Layout

GIB = 2**30


# ---------------------------------------------------------------------------------------------
# Parameters per rank


def layer_params(cfg: ModelConfig, tp: int = 1, ep: int = 1, etp: int | None = None) -> dict[str, int]:
    """Parameters of one block held by one rank: `sharded` (split by tp), `replicated` (norms, router) and
    `expert` (routed experts, split by ep and by etp: `layout.etp`, 1 for whole experts on every tp rank, tp when
    each expert's ffn dim is split over the tp ranks; tp when not given). `matmul` counts the weights autocast casts
    to bf16."""
    h, d = cfg.hidden, cfg.head_dim
    kv_local = max(cfg.n_kv_heads // tp, 1)
    attn = (h * cfg.n_heads * d // tp) + 2 * h * kv_local * d + (cfg.n_heads * d * h // tp)
    replicated = 2 * h
    expert = 0
    if cfg.is_moe:
        f = cfg.expert_ffn
        replicated += h * cfg.n_experts  # router
        expert = (cfg.n_experts // ep) * cfg.mlp_matrices * h * (f // (tp if etp is None else etp))
        mlp = cfg.n_shared_experts * cfg.mlp_matrices * h * f // tp
    else:
        mlp = cfg.mlp_matrices * h * cfg.ffn // tp
    return {"sharded": attn + mlp, "replicated": replicated, "expert": expert,
            "matmul": attn + mlp + expert + (h * cfg.n_experts if cfg.is_moe else 0)}


@dataclass(frozen=True)
class RankParams:
    dense: int  # parameters reduced over dp x cp (everything but routed experts)
    expert: int  # routed-expert parameters, reduced over dp x cp / ep
    matmul: int  # weights autocast casts to bf16 in forward (per micro-batch in flight)
    layers: int  # blocks on this rank (all virtual stages)
    first: bool
    last: bool

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_layers(cfg: ModelConfig, lay: Layout, seq: int) -> list[int]:
    """Blocks per global pipeline stage (pp x vpp stages, or 2 pp for the V-shaped schedule): the layout's own
    `stage_layers` when it gives them (as the engine takes them), else balanced by compute at the run's sequence
    length `seq`, as the engine balances them (`parallel.pipeline`; the output layer's share of a stage's work
    falls as the sequence grows: the tiny model's 4 blocks split 3 + 1 at 128 tokens and 2 + 2 at 4,096)."""
    if lay.stage_layers:
        return list(lay.stage_layers)
    n = lay.pp * (2 if lay.schedule == "dualpipev" and lay.pp > 1 else lay.vpp)
    return balanced_stage_layers(cfg, n, seq)


def rank_params(cfg: ModelConfig, lay: Layout, rank: str = "first", *, seq: int) -> RankParams:
    """Parameters that the `first` or `last` pipeline rank holds (the same rank when pp = 1) when the blocks are
    split for sequences of `seq` tokens (`stage_layers`)."""
    chunks = stage_layers(cfg, lay, seq)
    r = 0 if rank == "first" else lay.pp - 1
    if lay.schedule == "dualpipev" and lay.pp > 1:
        mine = [r, 2 * lay.pp - 1 - r]
    else:
        mine = [r + k * lay.pp for k in range(lay.vpp)]
    n = sum(chunks[s] for s in mine)
    n_stages = len(chunks)
    lp = layer_params(cfg, lay.tp, lay.ep, lay.etp)
    dense = n * (lp["sharded"] + lp["replicated"])
    matmul = n * lp["matmul"]
    holds_first = 0 in mine
    holds_last = n_stages - 1 in mine
    v_local = cfg.vocab_size // lay.tp
    if holds_first:
        dense += v_local * cfg.hidden
    if holds_last:
        dense += cfg.hidden  # final norm
        # the output layer: a copy of the embedding when tied across stages, or under ZeRO-3 over stages (one
        # parameter cannot belong to two stages' fully_shard roots, `parallel.pipeline_zero3`)
        if not (cfg.tied_embeddings and holds_first) or (lay.zero >= 3 and lay.pp > 1):
            dense += v_local * cfg.hidden
    return RankParams(dense, n * lp["expert"], matmul, n, holds_first, holds_last)


def _shard(n: int, parts: int) -> int:
    return math.ceil(n / parts) if parts > 1 else n


def model_state_bytes(cfg: ModelConfig, lay: Layout, fw: Framework, rank: str = "first", *,
                      seq: int) -> dict[str, int]:
    """Parameters, gradients, optimizer states (with the master copy) and the fp32 accumulation buffer of the
    `first` or `last` pipeline rank, its blocks split for sequences of `seq` tokens."""
    rp = rank_params(cfg, lay, rank, seq=seq)
    dpc = lay.zero_group  # dp x cp, or HSDP's shard group
    dpc_e = lay.expert_zero_group  # edp, or the ranks of HSDP's shard group that hold the same experts

    def sharded(bytes_per: int, on: bool) -> int:
        return bytes_per * (_shard(rp.dense, dpc if on else 1) + _shard(rp.expert, dpc_e if on else 1))

    optim_per = fw.optim_bytes + (fw.master_bytes if fw.zero_shards_master else 0)
    # fivefold's buckets hold the gradients in fp32 themselves under fp32_grad_accum (no buffer beside them)
    in_grads = lay.fp32_grad_accum and fw.accum_in_grad_buffers
    out = {
        "parameters": sharded(fw.param_bytes, lay.zero >= 3),
        "gradients": sharded(fw.accum_bytes if in_grads else fw.grad_bytes, lay.zero >= 2),
        "optimizer": sharded(optim_per, lay.zero >= 1),
    }
    if not fw.zero_shards_master:
        out["optimizer"] += fw.master_bytes * rp.total
    out["grad_accum_buffer"] = sharded(fw.accum_bytes, lay.zero >= 2) if lay.fp32_grad_accum and not in_grads else 0
    if lay.zero >= 3 and fw.master_bytes and fw.accum_in_grad_buffers:
        # fivefold's ZeRO-3 (fully_shard with a bf16 MixedPrecisionPolicy) keeps fp32 shards, which are the master
        # weights, and fp32 gradient shards whatever fp32_grad_accum says: 4 + 4 + 8 per parameter over the group
        out["parameters"] = sharded(fw.master_bytes, True)
        out["gradients"], out["grad_accum_buffer"] = sharded(fw.accum_bytes, True), 0
        out["optimizer"] = sharded(fw.optim_bytes, True)
    if fw.unsharded_accum_grad_bytes and lay.zero >= 2 and lay.grad_accum_steps > 1:
        # whole gradients held between micro-batches, beside the shards they are reduced into after the last
        out["gradients"] += sharded(fw.unsharded_accum_grad_bytes, False)
    return out


# the full gradient buckets a ZeRO-2 rank holds at most beside its gradient slice: `parallel.data.ZERO2_IN_FLIGHT`
# reduce-scatters in flight and the bucket filling (tests/test_planner_parallel.py checks it against the engine's)
ZERO2_FULL_BUCKETS = 3


def dp_bucket_bytes(lay: Layout, fw: Framework, elem_bytes: float) -> float:
    """Bytes of one gradient bucket: the layout's `dp_bucket_elements` of `elem_bytes` each for fivefold's engine
    under ZeRO-0/1/2 (`Framework.layout_dp_options`), else the framework's `dp_bucket_mib` (ZeRO-3's smallest
    message)."""
    if fw.layout_dp_options and lay.zero < 3:
        return lay.dp_bucket_elements * elem_bytes
    return fw.dp_bucket_mib * 2**20


def dp_buffer_bytes(lay: Layout, fw: Framework, rp: RankParams) -> float:
    """Data parallel's gradient buckets in flight beside what the model states count (dp x cp > 1). fivefold's
    engine (`Framework.layout_dp_options`): ZeRO-0/1 reduce each bucket in place (the buckets are the gradients),
    ZeRO-2 holds at most `ZERO2_FULL_BUCKETS` full buckets beside its slice, ZeRO-3 (`fully_shard`) none (its
    unsharded block gradients are counted with the gathers). Other frameworks: two buckets of `dp_bucket_mib`, one
    being reduced while the next fills. Never more than the rank's whole gradient: a bucket holds gradients."""
    if lay.dp * lay.cp == 1:
        return 0.0
    elem = reduced_grad_bytes(lay, fw)
    whole = rp.total * elem
    if not fw.layout_dp_options:
        return min(2 * fw.dp_bucket_mib * 2**20, whole)
    if lay.zero == 2:
        return min(ZERO2_FULL_BUCKETS * dp_bucket_bytes(lay, fw, elem), whole)
    return 0.0


def reduced_grad_bytes(lay: Layout, fw: Framework) -> int:
    """Bytes per gradient element that data parallel reduces: the fp32 accumulation's under `fp32_grad_accum`, and
    under fivefold's lean ZeRO-3 whatever it says (fully_shard's fp32 reduce dtype); else the gradients' own."""
    if lay.fp32_grad_accum or (lay.zero >= 3 and fw.master_bytes and fw.accum_in_grad_buffers):
        return fw.accum_bytes
    return fw.grad_bytes


# ---------------------------------------------------------------------------------------------
# Activations


def moe_capacity(cfg: ModelConfig, tokens: int, imbalance: float = 1.0) -> int:
    """Tokens per expert slot: fixed by the capacity factor, or (dropless) the busiest expert's load, modelled
    as `imbalance` times the even share."""
    even = tokens * cfg.top_k / cfg.n_experts
    if cfg.capacity_factor > 0:
        return max(1, math.ceil(cfg.capacity_factor * even))
    return max(1, math.ceil(imbalance * even))


def residual_bytes(cfg: ModelConfig, fw: Framework) -> int:
    """Bytes per element of the residual stream: the framework's, or 4 with `model.fp32_residual`."""
    return 4 if cfg.fp32_residual else fw.residual_bytes


SELECTIVE_MATMULS = ("q", "k", "v", "o", "gate", "up", "down")


def selective_matmuls(fw: Framework) -> set[str]:
    """The matmul outputs a block keeps under the framework's selective recompute (`selective_saved_matmuls`)."""
    names = {n.strip() for n in fw.selective_saved_matmuls.split(",") if n.strip()}
    unknown = names - set(SELECTIVE_MATMULS)
    if unknown:
        raise ConfigError(f"framework {shown(fw.name)}: selective_saved_matmuls names {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(SELECTIVE_MATMULS)}")
    return names


def routed_tokens(tokens: float, lay: Layout) -> float:
    """Tokens one rank's router sees and dispatches per MoE layer out of the `tokens` of its micro-batch (after cp):
    all of them with experts split over tp (`layout.etp = tp`, every tp rank routing the gathered sequence), its
    own 1/tp with whole experts under tp (`layout.etp = 1`, `LayoutConfig.splits_tokens_over_tp`)."""
    return tokens / lay.tp if lay.splits_tokens_over_tp else tokens


def expert_ffn_local(cfg: ModelConfig, lay: Layout) -> int:
    """The ffn width of one routed expert on a rank: whole (`layout.etp = 1`) or split over tp (`etp = tp`)."""
    return cfg.expert_ffn // lay.etp if lay.tp > 1 else cfg.expert_ffn


def busiest_rank_load(cfg: ModelConfig, ep: int, imbalance: float = 1.0) -> float:
    """The busiest ep rank's routed slots over the even share (1: balanced routing), when the busiest expert gets
    `imbalance` times the even share and the other E - 1 experts split the rest evenly: that expert and E/ep - 1
    others, [X + (E/ep - 1)(E - X)/(E - 1)] / (E/ep). 1 without ep (one rank runs every expert, dropless), X with
    one expert per rank."""
    e = cfg.n_experts
    local = e // ep
    if imbalance == 1.0 or local == e or e <= 1:
        return 1.0
    return (imbalance + (local - 1) * (e - imbalance) / (e - 1)) / local


def splits_backward(lay: Layout) -> bool:
    """A pipeline whose schedule computes the weight gradients in W passes of their own (zero-bubble, DualPipeV)."""
    return lay.pp > 1 and lay.schedule in SPLIT_BACKWARD


def runs_tp_overlap(lay: Layout, fw: Framework) -> bool:
    """fivefold's engine runs its own tensor-parallel overlap (`layout.tp_comm_overlap` with sp) on its plain linears
    (float8 linears take the gathered input through their modules); other frameworks' overlap is priced by their
    `tp_overlap` and `async_tp` fields."""
    return (fw.layout_dp_options and lay.overlaps_tp_comm and not (fw.async_tp or fw.tp_overlap)
            and not fw.float8_linears)


def fuses_row_linears(lay: Layout, fw: Framework) -> bool:
    """Whether the overlap fuses the row linears (o, down) with their reduce-scatter (`tensor_comm.linear_scatter`):
    eager blocks whose backward computes the weight gradients (a compiled block runs them unfused; a split
    backward's W pass takes them off the fused path, as a pipeline's overlap does for each stage's first block,
    which this leaves out). Selective recompute then keeps their outputs (`tensor_comm.CollectiveStore`)."""
    return runs_tp_overlap(lay, fw) and not fw.compiled and not splits_backward(lay)


def keeps_ring(lay: Layout, fw: Framework) -> bool:
    """Whether selective recompute keeps ring attention's output and log-sum-exp (fivefold's engine:
    `context.RingAttention` with the block's `CollectiveStore`), so that its recomputation passes nothing around the
    cp ring (other engines recompute the attention core, the ring with it)."""
    return fw.layout_dp_options and lay.recompute == "selective" and lay.cp > 1


def keeps_ep_exchanges(lay: Layout, fw: Framework) -> bool:
    """Whether selective recompute keeps what the expert-parallel exchanges received (fivefold's engine:
    `expert.ExpertParallelDispatch` with the block's `CollectiveStore`), so that its recomputation exchanges nothing."""
    return fw.layout_dp_options and lay.recompute == "selective" and lay.ep > 1


def layer_activation_bytes(cfg: ModelConfig, tokens: int, lay: Layout, fw: Framework,
                           moe_imbalance: float = 1.0) -> dict[str, float]:
    """Bytes one block saves for backward for one micro-batch of `tokens` tokens on this rank (after cp)."""
    h, d, tp = cfg.hidden, cfg.head_dim, lay.tp
    ab, rb = fw.act_bytes, residual_bytes(cfg, fw)
    t_seq = tokens / tp if (lay.sp and tp > 1) else tokens  # the sequence-sharded norm/residual regions
    compiled = fw.compiled and fw.compiled_saves_less  # a compiled block saves less than eager (and differently)
    # what the column linears save: their sequence slice, or, compiled, the gathered input (the partitioner keeps
    # the gather's output rather than gather again in backward; so on the H200 with the tp overlap on and off alike,
    # 72.24 GiB on the 70B example's first rank, where the CPU's compile keeps the slice with the overlap on)
    t_in = tokens if (fw.sp_saves_gathered_input or not lay.sp or compiled) else t_seq
    t_route = routed_tokens(tokens, lay)  # what this rank's router sees (its own 1/tp with whole experts)
    norm = t_seq * (h * rb + 4 + (h * 4 if fw.norm_saves_normalized else 0))  # input, 1/rms, normalised input
    if lay.recompute == "full":
        return {"block_input": t_seq * h * rb, "total": t_seq * h * rb}
    if lay.recompute == "selective":  # the block input and the outputs of the weight matmuls and attention kernel
        heads, kv = cfg.n_heads // tp, max(cfg.n_kv_heads // tp, 1)
        kept = selective_matmuls(fw)
        widths = {"q": heads * d, "k": kv * d, "v": kv * d, "o": h}
        # the attention kernel's output and fp32 log-sum-exp, and the kept projections (all four: q k v, o)
        attn = tokens * (heads * d + sum(w for n, w in widths.items() if n in kept)) * ab + tokens * heads * 4
        if cfg.is_moe:  # router logits and the shared experts' gate, up, down (the routed experts' bmm recompute)
            fs = cfg.n_shared_experts * cfg.expert_ffn // tp
            mlp = (t_route * cfg.n_experts + tokens * ((cfg.mlp_matrices - 1) * fs + h if fs else 0)) * ab
            if keeps_ep_exchanges(lay, fw):  # the rows this rank's experts received (the busiest rank's) and the
                # outputs that came back, one per (token, choice)
                k = cfg.top_k
                mlp += (t_route * k * busiest_rank_load(cfg, lay.ep, moe_imbalance) + t_route * k) * h * ab
        else:
            f_local = cfg.ffn // tp
            widths = {"gate": f_local, "up": f_local, "down": h} if cfg.mlp == "swiglu" else {"up": f_local, "down": h}
            mlp = tokens * sum(w for n, w in widths.items() if n in kept) * ab
        if fuses_row_linears(lay, fw):  # the row linears' reduce-scattered outputs (o, a dense MLP's down)
            attn += t_seq * h * ab
            mlp += 0 if cfg.is_moe else t_seq * h * ab
        total = (t_seq * h * rb + attn + mlp) * fw.activation_scale
        return {"block_input": t_seq * h * rb, "attention": attn, "mlp": mlp, "total": total}
    per_op = ab == 2 and fw.autocast_weight_copies  # autocast casts the norm output once per linear reading it
    casts = 3 if per_op else 1
    heads = cfg.n_heads // tp
    kv = max(cfg.n_kv_heads // tp, 1)
    attn = tokens * (2 * heads * d + 2 * kv * d) * ab
    lse = tokens * heads * 4
    attn_total = norm + casts * t_in * h * ab + attn + lse
    # the norm output, cast per linear reading it (gate and up; up alone for GELU); MoE gathers before routing,
    # except with whole experts under sp, whose router reads the rank's slice (the shared experts the gathered input)
    moe_in = tokens
    if lay.splits_tokens_over_tp and lay.sp:
        moe_in = t_route + (tokens if cfg.n_shared_experts else 0)
    mlp_in = (cfg.mlp_matrices - 1 if per_op else 1) * (moe_in if cfg.is_moe else t_in) * h * ab
    # saved per element of the MLP width: gate and up outputs, silu(gate) and the product (SwiGLU; compiled, silu
    # is recomputed in backward); the up output (GELU's input) and GELU's output
    saved = (3 if compiled else 4) if cfg.mlp == "swiglu" else 2
    if cfg.is_moe:
        e, k = cfg.n_experts, cfg.top_k
        t_r = t_route  # the whole (gathered) sequence, or with whole experts under tp the rank's 1/tp
        e_local = e // lay.ep
        f = expert_ffn_local(cfg, lay)
        logits = ab if compiled else 4  # the router logits: in the compute dtype when compiled, else fp32
        routing = t_r * (e * logits + k * 8 + 4 + k * 4) + e * 4 + 4 * t_r * k * 8 + t_r * k * 4
        if cfg.moe_impl == "grouped" and cfg.capacity_factor == 0:
            # dropless grouped GEMMs: the slots this rank's experts receive, no padding; the busiest ep rank's
            slots = t_r * k * busiest_rank_load(cfg, lay.ep, moe_imbalance)
        else:  # every local expert padded to the capacity (the busiest expert's load) from each of the ep ranks;
            # a capacity factor counts it over the whole (cp-local) sequence, whichever tp rank routes which part
            cap_tokens = tokens if cfg.capacity_factor > 0 else t_r
            slots = e_local * moe_capacity(cfg, int(cap_tokens), moe_imbalance) * lay.ep
        # the experts' input and hidden tensors per slot; their output per (token, choice), and eager also its
        # weighted copy
        experts = slots * (h + saved * f) * ab + (1 if compiled else 2) * t_r * k * h * ab
        shared = saved * tokens * cfg.n_shared_experts * cfg.expert_ffn // tp * ab
        mlp = routing + experts + shared
    else:
        mlp = saved * tokens * (cfg.ffn // tp) * ab
    mlp_total = norm + mlp_in + mlp
    total = (attn_total + mlp_total) * fw.activation_scale
    return {"attention": attn_total, "mlp": mlp_total, "total": total}


def layer_weight_grad_bytes(cfg: ModelConfig, tokens: int, lay: Layout, fw: Framework) -> float:
    """Bytes one block's pending W pass keeps for one micro-batch of `tokens` tokens on this rank (a split backward:
    zero-bubble, DualPipeV): the inputs and output gradients of the linears that defer their weight gradient (the
    bias-free projections of attention, the dense or shared-expert MLP and the router; the routed experts compute
    theirs in B). Under sequence parallel the gathered linears keep their local input and gather it again in W."""
    h, d, tp, ab = cfg.hidden, cfg.head_dim, lay.tp, fw.act_bytes
    t_in = tokens / tp if (lay.sp and tp > 1) else tokens
    heads, kv = cfg.n_heads // tp, max(cfg.n_kv_heads // tp, 1)
    total = 0.0
    if not cfg.qkv_bias:  # biased q/k/v compute their gradients in B
        total += t_in * h + tokens * (heads + 2 * kv) * d
    total += tokens * heads * d + tokens * h  # o: its input and its output's gradient
    matrices = cfg.mlp_matrices - 1  # the column linears reading the norm output (gate and up, or up)
    if cfg.is_moe:
        f = cfg.n_shared_experts * cfg.expert_ffn // tp
        t_route = routed_tokens(tokens, lay)
        total += t_route * h + t_route * cfg.n_experts  # the router (the rank's own tokens with whole experts)
        if f:
            total += t_in * h + matrices * tokens * f + tokens * f + tokens * h
    else:
        f = cfg.ffn // tp
        total += t_in * h + matrices * tokens * f + tokens * f + tokens * h  # gate/up, down
    return total * ab


def stage_activation_bytes(cfg: ModelConfig, tokens: int, seq_local: int, lay: Layout, fw: Framework,
                           rp: RankParams, moe_imbalance: float = 1.0) -> float:
    """Saved bytes of one micro-batch on a rank holding `rp` (all its layers, embedding and loss parts)."""
    per_layer = layer_activation_bytes(cfg, tokens, lay, fw, moe_imbalance)["total"]
    total = rp.layers * per_layer + 2 * seq_local * cfg.head_dim * residual_bytes(cfg, fw)  # rotary tables
    t_seq = tokens / lay.tp if (lay.sp and lay.tp > 1) else tokens
    if rp.first:
        # token ids saved by the embedding lookup (vocabulary-parallel: the local ids and the out-of-range mask)
        total += tokens * (8 + (1 if lay.tp > 1 else 0))
    if rp.last:
        final_norm = cfg.hidden * residual_bytes(cfg, fw) + 4 + (cfg.hidden * 4 if fw.norm_saves_normalized else 0)
        total += t_seq * final_norm
        if fw.fused_loss_chunk:  # fused output layer + loss: gradients of the hidden states and of the weight,
            # computed in forward and kept in the hidden states' and the weight's dtypes
            total += tokens * cfg.hidden * fw.residual_bytes + cfg.vocab_size // lay.tp * cfg.hidden * fw.param_bytes
        else:
            total += tokens * cfg.hidden * fw.act_bytes
    return total


def forward_saved_bytes(cfg: ModelConfig, batch: int, seq: int, lay: Layout, fw: Framework,
                        moe_imbalance: float = 1.0) -> float:
    """Saved-for-backward bytes of one forward pass of `batch` sequences of `seq` tokens, whole model on one
    pipeline rank (the quantity the tests measure with saved-tensor hooks)."""
    single = dataclasses.replace(lay, pp=1, vpp=1)
    rp = rank_params(cfg, single, seq=seq)
    tokens = batch * seq // lay.cp
    return stage_activation_bytes(cfg, tokens, seq // lay.cp, single, fw, rp, moe_imbalance)


# ---------------------------------------------------------------------------------------------
# Peak per rank


def loss_peak_bytes(fw: Framework, tp: int) -> float:
    """Bytes per (token, vocabulary entry / tp) that the loss holds at the memory peak: `tp_loss_peak_bytes` for
    the vocabulary-parallel loss under tensor parallel, else `loss_peak_bytes`, else `logits_bytes`."""
    if tp > 1 and fw.tp_loss_peak_bytes:
        return fw.tp_loss_peak_bytes
    return fw.loss_peak_bytes or fw.logits_bytes


@dataclass
class MemoryReport:
    rank: str
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return sum(self.parts.values())


def rank_memory(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, in_flight: float, rank: str = "first",
                moe_imbalance: float = 1.0, held: tuple[tuple[float, float], ...] = ()) -> MemoryReport:
    """Peak bytes of the first or last pipeline rank, with `in_flight` micro-batches of stage activations; or,
    for a split backward, at the largest of `held`'s (activations, pending W passes) pairs
    (`parallel.schedules.held_points`)."""
    rp = rank_params(cfg, lay, rank, seq=seq)
    rep = MemoryReport(rank, dict(model_state_bytes(cfg, lay, fw, rank, seq=seq)))
    tokens = lay.micro_batch_size * seq // lay.cp
    act = stage_activation_bytes(cfg, tokens, seq // lay.cp, lay, fw, rp, moe_imbalance)
    rep.parts["activations"] = act * in_flight
    rep.parts["pending_weight_grads"] = 0.0
    if held and lay.recompute == "none":  # (a recomputed block's W keeps what its recompute rebuilt: not modelled)
        w = rp.layers * layer_weight_grad_bytes(cfg, tokens, lay, fw)
        acts, pending = max(held, key=lambda x: x[0] * act + x[1] * w)
        rep.parts["activations"], rep.parts["pending_weight_grads"] = acts * act, pending * w
    copies = 0.0
    if fw.autocast_weight_copies and lay.recompute == "none":  # selective recomputes the casts too
        copies = 2 * rp.matmul * in_flight
    rep.parts["bf16_weight_copies"] = copies
    # transient: the loss chunk on the last stage, or one recomputed block during backward
    transient = 0.0
    v_local = cfg.vocab_size // lay.tp
    if rp.last:
        loss_chunk = fw.tp_loss_chunk if lay.tp > 1 else fw.fused_loss_chunk
        chunk = min(loss_chunk, tokens) if fw.fused_loss_chunk else tokens
        transient = chunk * v_local * loss_peak_bytes(fw, lay.tp)
        if fw.fused_loss_chunk and fw.compute_dtype == "bf16":
            transient += v_local * cfg.hidden * 2  # the bf16 cast of the output weight
    if lay.recompute != "none":  # what one block's recompute rebuilds during its backward
        none = layer_activation_bytes(cfg, tokens, dataclasses.replace(lay, recompute="none"), fw, moe_imbalance)
        kept = layer_activation_bytes(cfg, tokens, lay, fw, moe_imbalance)
        transient = max(transient, none["total"] - (kept["total"] if lay.recompute == "selective" else 0))
    rep.parts["transient"] = transient
    lp = layer_params(cfg, lay.tp, lay.ep, lay.etp)
    comm = dp_buffer_bytes(lay, fw, rp)
    if lay.zero >= 3 and lay.pp > 1:
        # ZeRO-3 over pipeline stages (`parallel.pipeline_zero3`): the rank's stages stay gathered for the whole
        # step and their gradients unsharded until each stage's last backward (accumulated in fp32 under bf16
        # gathers, fully_shard's reduce dtype); under ep the experts are gathered over edp, or with edp = 1 stay whole
        # (plain tensors, counted with the model states), as in plain ZeRO-3
        held = rp.dense + (rp.expert if not lay.experts_apart or lay.edp > 1 else 0)
        gathered = fw.gather_bytes or fw.param_bytes
        comm += held * gathered + held * (4 if fw.gather_bytes else fw.grad_bytes)
    elif lay.zero >= 3:
        dense = lp["sharded"] + lp["replicated"]
        gathered = fw.gather_bytes or fw.param_bytes
        if lay.experts_apart:  # the experts are a unit of their own over edp (under ep, or whole on every tp rank
            # with etp = 1), gathered in the MoE's own passes (not prefetched with the block); with edp = 1 they stay
            # whole, counted with the model states
            experts = lp["expert"] if lay.edp > 1 else 0
            comm += (2 * dense + experts) * gathered + (dense + experts) * fw.grad_bytes
        else:
            block = dense + lp["expert"]
            comm += 2 * block * gathered + block * fw.grad_bytes  # current + prefetched block, unsharded grads
        # the root unit (embedding, final norm, output layer) stays gathered for the whole micro-batch
        comm += (rp.dense - rp.layers * (lp["sharded"] + lp["replicated"])) * gathered
    rep.parts["comm_buffers"] = comm
    rep.parts["fixed_overhead"] = fw.fixed_overhead_gib * GIB
    return rep


def with_heap_retention(mem: dict[str, dict[str, float]], retention: float) -> dict[str, dict[str, float]]:
    """`mem` (pipeline rank -> part -> bytes) with the `allocator_cache` part of a profile's `heap_retention`: what
    the C allocator keeps of freed memory beside the live tensors, (retention - 1) x the rank's live bytes (a CPU
    run's resident set is measured, and glibc returns little of what a step frees). Unchanged at retention 1;
    applying it twice is applying it once."""
    if retention <= 1.0:
        return mem
    out = {}
    for rank, parts in mem.items():
        live = sum(v for k, v in parts.items() if k != "allocator_cache")
        out[rank] = {**parts, "allocator_cache": (retention - 1.0) * live}
    return out
