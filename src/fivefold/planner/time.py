"""Step time of a layout: compute by kernel class, communication with its overlap, and the pipeline schedule
simulated action by action.

Compute FLOPs come from `fivefold.flops.training_flops_per_token`, the function the trainer logs MFU with;
only their speed depends on the kernels. Without a calibrated profile each class has its own figure per device
(`planner/kernels.py`, `planner/devices/kernels.toml`, every figure with its source): a block's GEMMs at the
device's large-GEMM efficiency (`matmul_efficiency`) times a shape term (small dimensions run slower) and the
roofline of their arithmetic intensity, float8 GEMMs faster by the device's FP8 figure; causal attention at the
published FlashAttention speed for its head dim and sequence length; norms, rotary embedding, SwiGLU and residual
adds by the bytes they stream (eager PyTorch ops, or fused kernels: `Framework.fused_elementwise`) at the device's
achieved HBM bandwidth; plus a per-kernel launch cost. With a calibrated profile the measured tables replace them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from fivefold.config import ModelConfig
from fivefold.flops import (
    DocumentLengths,
    attention_flops_per_token,
    attention_fraction,
    training_flops_per_token,
)
from fivefold.layout import SCATTER_PIECES
from fivefold.parallel.schedules import build_schedule, simulate
from fivefold.planner import comm
from fivefold.planner.hardware import Cluster
from fivefold.planner.kernels import ATTENTION_BACKWARD_FLOPS, DeviceKernels, device_kernels
from fivefold.planner.layout import Framework, Layout
from fivefold.planner.memory import (
    RankParams,
    busiest_rank_load,
    dp_bucket_bytes,
    expert_ffn_local,
    fuses_row_linears,
    keeps_ring,
    layer_params,
    model_state_bytes,
    rank_params,
    reduced_grad_bytes,
    routed_tokens,
    runs_tp_overlap,
    selective_matmuls,
    splits_backward,
    stage_layers,
)

# schedules with more F actions than this are timed with the closed form (simulating them takes seconds)
EXACT_MAX_ACTIONS = 8192

# bytes per element that each element-wise kernel class streams in a block's forward, with bf16 tensors: eager
# PyTorch ops (each op reads its inputs and writes its output, fp32 inside the norm and the rotation) and one fused
# kernel (torch.compile, Triton or Transformer Engine kernels). The backward streams twice the forward's.
ELEMENTWISE_BYTES = {
    "norm": (36.0, 4.0),  # RMSNorm: cast up 2+4, square 4+4, mean 4, scale 4+4, cast down 4+2, weight 2+2 | 2+2
    "residual": (6.0, 2.0),  # x + y: 2+2+2 | fused into the next norm, which reads the sum anyway: its write
    "rotary": (20.0, 4.0),  # q and k: cast up 2+4, complex multiply 4+4, cast down 4+2 | 2+2
    "swiglu": (10.0, 6.0),  # silu(gate) 2+2, times up 2+2+2 | gate and up in, product out
}
ELEMENTWISE_CLASSES = tuple(ELEMENTWISE_BYTES)
# a GELU MLP's activation in the "swiglu" class's place (the MLP activation): up's output in, GELU's out, 2+2 in
# one kernel, eager or fused
GELU_BYTES = (4.0, 4.0)
# bytes per element of a float8 linear's input (forward) and output gradient (backward) for the scale and cast
# (amax read, cast read + write of one byte; torchao's dynamic tensorwise scaling)
FLOAT8_CAST_BYTES = 5.0


def fused_classes(fw: Framework) -> set[str]:
    """The element-wise kernel classes a framework runs fused ("all" for every class)."""
    names = {c.strip() for c in fw.fused_elementwise.split(",") if c.strip()}
    return set(ELEMENTWISE_CLASSES) if "all" in names else names


def elementwise_bytes(cfg: ModelConfig, tokens: float, tp: int, sp: bool, fw: Framework) -> float:
    """Bytes that one block's element-wise kernels stream in the forward on one tensor-parallel rank: two norms
    and two residual adds on the hidden states (a sequence slice under sp), the rotation of q and k, SwiGLU on
    the rank's share of the MLP (the routed experts' share for MoE; GELU for a GELU MLP)."""
    fused = fused_classes(fw)
    per = {c: ELEMENTWISE_BYTES[c][1 if c in fused else 0] for c in ELEMENTWISE_CLASSES}
    if cfg.mlp == "gelu":
        per["swiglu"] = GELU_BYTES[1 if "swiglu" in fused else 0]
    hidden = cfg.hidden / (tp if sp else 1)
    rotated = (cfg.n_heads // tp + max(cfg.n_kv_heads // tp, 1)) * cfg.head_dim
    mlp = (cfg.expert_ffn * (cfg.top_k + cfg.n_shared_experts) if cfg.is_moe else cfg.ffn) / tp
    per_token = 2 * hidden * (per["norm"] + per["residual"]) + rotated * per["rotary"] + mlp * per["swiglu"]
    return tokens * per_token * fw.act_bytes / 2


def gemm_efficiency(m: float, n: float, k: float, ab: int, hw: Cluster, dk: DeviceKernels) -> float:
    """Achieved share of the peak of one GEMM: the cluster's large-GEMM efficiency times the shape term and the
    roofline of its arithmetic intensity against the device's FLOP/byte ridge."""
    intensity = 2 * m * n * k / (ab * (m * k + k * n + m * n))
    ridge = hw.peak_flops() / (hw.hbm_gbps * 1e9)
    return min(0.99, hw.matmul_efficiency * dk.gemm_factor(m, n, k) * min(1.0, intensity / ridge))


def _weighted_eff(gemms: list[tuple[float, float, float]], ab: int, hw: Cluster, dk: DeviceKernels) -> float:
    """Efficiency of a set of matmuls, weighted by their FLOPs (harmonic: times add up)."""
    flops = [m * n * k for m, n, k in gemms]
    time = sum(f / gemm_efficiency(m, n, k, ab, hw, dk) for f, (m, n, k) in zip(flops, gemms, strict=True))
    return sum(flops) / time


def attention_seconds(fwd_flops: float, head_dim: float, seq: float, fw: Framework, hw: Cluster,
                      dk: DeviceKernels, peak: float) -> tuple[float, float]:
    """Forward and backward seconds of causal attention worth `fwd_flops` (the model's forward FLOPs, which equal
    FlashAttention's causal count) with kernels over `seq` tokens: at the published speed of the framework's
    kernel, scaled by the cluster's GEMM efficiency over the device's published one; as GEMMs (backward twice the
    forward) on a device without attention figures."""
    rates = dk.attention_tflops(fw.attention_kernel, head_dim, seq)
    if rates is None or fw.compute_dtype != "bf16":
        f = fwd_flops / (peak * hw.matmul_efficiency)
        return f, 2 * f
    scale = hw.matmul_efficiency / dk.gemm_efficiency * 1e12
    return fwd_flops / (rates[0] * scale), ATTENTION_BACKWARD_FLOPS * fwd_flops / (rates[1] * scale)


def exposed(comm_time: float, compute_time: float, overlap: float) -> float:
    """What a collective adds to a step when `compute_time` of compute runs beside it and a share `overlap` of
    it can hide behind compute (1 on GPUs with their own communication engines, ~0 where the same CPU cores
    compute and communicate)."""
    return overlap * max(0.0, comm_time - compute_time) + (1 - overlap) * comm_time


@dataclass
class StageTimes:
    f: list[float]  # forward per micro-batch, per global stage
    b: list[float]  # input-gradient backward (the whole backward minus W)
    w: list[float]  # weight-gradient pass
    comm_per_layer: dict[str, float] = field(default_factory=dict)  # exposed, per block and micro-batch
    counts: list[int] = field(default_factory=list)  # blocks per stage
    comm_per_micro_batch: dict[str, float] = field(default_factory=dict)  # outside the blocks (embedding, loss)
    host_wait: list[float] = field(default_factory=list)  # per stage and micro-batch: the GPU waiting for the host
    # per stage and micro-batch: the exposed collectives inside F and inside B (tp, cp, ep, the loss's), which
    # DualPipeV's overlapped pairs hide behind the other lane's compute (`fb_pair_seconds`)
    comm_f: list[float] = field(default_factory=list)
    comm_b: list[float] = field(default_factory=list)
    comm_w: list[float] = field(default_factory=list)  # inside W (a split schedule's re-gathers under sp)
    # per stage and micro-batch: the part of the backward that runs after its input gradient has been sent to the
    # previous stage (fivefold's `layout.pp_comm_overlap` defers the stage's first block's weight gradients past
    # the send, `train.build.weight_grad_queue`; empty: the send waits for the whole backward)
    after_send: list[float] = field(default_factory=list)


def linear_shapes(cfg: ModelConfig, tokens: float, tp: int, fused: bool, etp: int | None = None,
                  load: float = 1.0) -> list[tuple[float, float, float]]:
    """(m, n, k) of each linear layer of a block on one tp rank: q, k, v, o, gate, up, down (the fused
    q|k|v and gate|up of frameworks that fuse them; no gate in a GELU MLP); MoE experts as their share of the
    routed tokens: all the tokens on 1/tp of each expert's ffn dim (`etp` = tp, the default here), or under tp with
    whole experts (`etp` = 1) the rank's own 1/tp of the tokens on whole experts (the same FLOPs); `load` times
    the even share of them (the busiest ep rank's, `memory.busiest_rank_load`)."""
    ins = cfg.mlp_matrices - 1  # the MLP's input projections: gate and up, or up
    h, d = cfg.hidden, cfg.head_dim
    kv = max(cfg.n_kv_heads // tp, 1) * d
    q = cfg.n_heads * d // tp
    attn = [(tokens, q + 2 * kv, h)] if fused else [(tokens, q, h), (tokens, kv, h), (tokens, kv, h)]
    attn.append((tokens, h, q))
    if cfg.is_moe:
        whole = tp > 1 and etp == 1
        f = cfg.expert_ffn // (1 if whole else tp)
        mine = tokens / tp if whole else tokens  # the tokens this rank routes
        routed = mine * cfg.top_k / cfg.n_experts * load
        mlp = [(routed, f, h)] * (ins * cfg.n_experts) + [(routed, h, f)] * cfg.n_experts \
            + [(mine, cfg.n_experts, h)]
        if cfg.n_shared_experts:
            fs = cfg.expert_ffn // tp * cfg.n_shared_experts
            mlp += [(tokens, fs, h)] * ins + [(tokens, h, fs)]
        return attn + mlp
    f = cfg.ffn // tp
    return attn + ([(tokens, ins * f, h)] if fused else [(tokens, f, h)] * ins) + [(tokens, h, f)]


def selective_reruns_linear(cfg: ModelConfig, fw: Framework, fused: bool) -> list[bool]:
    """For each linear of `linear_shapes` (same order, `fused` alike), whether the framework's selective recompute
    runs it again: a projection whose output `selective_saved_matmuls` does not keep (a fused one unless it keeps
    all its parts) and the routed experts (grouped or batched matmuls, which the policy does not keep); the router
    is kept."""
    kept = selective_matmuls(fw) | {"router"}
    mlp_in = ["gate", "up"][-(cfg.mlp_matrices - 1):]
    attn = [{"q", "k", "v"}] if fused else [{"q"}, {"k"}, {"v"}]
    mlp = [set(mlp_in)] if fused else [{n} for n in mlp_in]
    names = [*attn, {"o"}]
    if cfg.is_moe:
        names += [{"routed"}] * (cfg.n_experts * cfg.mlp_matrices) + [{"router"}]
        names += [{n} for n in mlp_in] + [{"down"}] if cfg.n_shared_experts else []
    else:
        names += [*mlp, {"down"}]
    return [not n <= kept for n in names]


class _BlockSeconds(NamedTuple):
    """Forward (f) and backward (b) seconds of one block's linears, attention core, element-wise work and fixed
    costs, and of the output layer + loss; `hbm` the memory bandwidth (bytes/s) the estimate used."""

    lin_f: float
    lin_b: float
    attn_f: float
    attn_b: float
    elementwise: float
    oh_f: float
    oh_b: float
    oh_rerun: float  # the forward's fixed costs of its element-wise operators alone (what a selective rerun pays)
    lin_rerun: float  # the forward seconds of the linears that the framework's selective recompute runs again
    head_f: float
    head_b: float
    hbm: float


def attention_kernel_length(cfg: ModelConfig, seq: int, cp: int, docs: DocumentLengths | None) -> float:
    """The sequence length at which the attention kernel's speed is read: a cp rank's chunk; under a document mask
    or a sliding window, no longer than the causal length with as many keys per query as the mask leaves
    ((length + 1) / 2 = executed pairs / seq), since the kernel then works on blocks that short."""
    if not cfg.masks_attention:
        return seq / cp
    return min(seq / cp, max(1.0, attention_fraction(cfg, seq, docs) * (seq + 1) - 1))


def routed_expert_seconds(cfg: ModelConfig, tokens: float, lay: Layout, fw: Framework, hw: Cluster,
                          dk: DeviceKernels, moe_imbalance: float = 1.0) -> float:
    """Forward seconds of one MoE block's routed experts on the busiest ep rank, by kernel class: their forward FLOPs
    (2 x matrices x hidden x expert ffn per routed slot; per rank the tokens x top_k / tp slots, whichever way etp
    splits them) times that rank's load over the even share (`memory.busiest_rank_load`), at the device's grouped
    GEMM efficiency (`DeviceKernels.grouped_gemm_efficiency`, dropless `grouped_mm`); the padded batched matmul
    (`model.moe_impl = "padded"`) at the large-GEMM efficiency of the expert shape, every expert padded to the
    busiest one's load (the imbalance itself)."""
    if not cfg.is_moe:
        return 0.0
    peak = hw.peak_flops(fw.compute_dtype)
    flops = 2 * cfg.mlp_matrices * cfg.hidden * cfg.expert_ffn * cfg.top_k * tokens / lay.tp
    if cfg.moe_impl == "padded" or cfg.capacity_factor > 0:
        load = max(moe_imbalance, cfg.capacity_factor) if cfg.capacity_factor > 0 else moe_imbalance
        slots = routed_tokens(tokens, lay) * cfg.top_k / cfg.n_experts * load
        f = expert_ffn_local(cfg, lay)
        eff = _weighted_eff([(slots, f, cfg.hidden), (slots, cfg.hidden, f)], fw.act_bytes, hw, dk)
        return flops * load / (peak * eff)
    # a profile's fitted matmul_efficiency scales the class in proportion, as it scales attention
    eff = dk.grouped_gemm_efficiency * hw.matmul_efficiency / dk.gemm_efficiency
    return flops * busiest_rank_load(cfg, lay.ep, moe_imbalance) / (peak * eff)


def _block_seconds(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, hw: Cluster, tokens: float,
                   chunk: float, docs: DocumentLengths | None = None, moe_imbalance: float = 1.0) -> _BlockSeconds:
    """A block's and the output layer's compute seconds: measured per shape on a calibrated profile, else by kernel
    class (GEMMs with the shape term, attention from the published table, element-wise by bytes). Attention is
    the pairs the model's mask executes (`fivefold.flops.attention_flops_per_token`, `docs` under a document
    mask)."""
    h, d, tp = cfg.hidden, cfg.head_dim, lay.tp
    ab = fw.act_bytes
    peak = hw.peak_flops(fw.compute_dtype)
    # FLOPs from the one formula: per layer and the output layer, forward only (one third of training)
    per_token = training_flops_per_token(cfg, seq, docs=docs)
    head_flops = 6 * cfg.vocab_size * h
    attn_flops = attention_flops_per_token(cfg, seq, docs)  # causal: half of 12 L s h; less when masked
    kernel_seq = attention_kernel_length(cfg, seq, lay.cp, docs)
    layer_fwd = (per_token - head_flops - attn_flops) / cfg.n_layers / 3 * tokens / tp
    attn_fwd = attn_flops / cfg.n_layers / 3 * tokens / tp
    head_fwd = head_flops / 3 * tokens / tp
    kv = max(cfg.n_kv_heads // tp, 1)
    hbm = hw.hbm_gbps * 1e9
    # forward (f) and backward (b) seconds of a block's linears, attention core, element-wise work, fixed costs
    load = busiest_rank_load(cfg, lay.ep, moe_imbalance) if cfg.is_moe else 1.0
    shapes = linear_shapes(cfg, tokens, tp, fw.fused_projections, lay.etp, load)
    measured = [hw.linear_time(*shape) for shape in shapes]
    calibrated = bool(measured) and all(measured)
    if calibrated:  # a calibrated profile: measured per shape
        attn = hw.attention_time(lay.micro_batch_size * cfg.n_heads / tp, seq / lay.cp, d) or (0.0, 0.0)
        lin_f, lin_b = sum(t[0] for t in measured), sum(t[1] for t in measured)
        attn_f, attn_b = attn
        if cfg.masks_attention:  # the measured causal kernel, for the share of its pairs the mask executes
            share = attention_fraction(cfg, seq, docs)
            attn_f, attn_b = attn_f * share, attn_b * share
        # the element-wise operators' bytes as the kernel-class path counts them, at the measured speed for the
        # size of one hidden-state tensor
        elementwise = elementwise_bytes(cfg, tokens, tp, lay.sp, fw) / hw.elementwise_bandwidth(
            tokens * h * ab / (tp if lay.sp else 1))
        oh_f = oh_rerun = fw.kernels_per_layer * hw.kernel_overhead_us * 1e-6 * hw.compute_scale
        oh_b = fw.kernels_per_layer * hw.backward_overhead() * hw.compute_scale
        n_chunks = tokens / chunk
        head = hw.loss_time(chunk, cfg.vocab_size / tp, h)  # output layer and softmax as measured together
        if head is None:
            head = hw.linear_time(chunk, cfg.vocab_size / tp, h) or (0.0, 0.0)
            logits = tokens * cfg.vocab_size / tp * fw.logits_bytes * 2 / hw.elementwise_bandwidth(
                chunk * cfg.vocab_size / tp * 4)
        else:
            logits = 0.0
        head_f = n_chunks * head[0] + logits + fw.kernels_per_micro_batch * hw.kernel_overhead_us * 1e-6 \
            * hw.compute_scale
        head_b = n_chunks * head[1] + fw.kernels_per_micro_batch * hw.backward_overhead() * hw.compute_scale
    else:  # by kernel class: GEMMs with the shape term, attention from the published table, element-wise by bytes
        dk = device_kernels(hw.device)
        # the dense linears (the shared experts for MoE): the routed experts are a class of their own
        mlp = (cfg.expert_ffn * cfg.n_shared_experts if cfg.is_moe else cfg.ffn) // tp
        gemms = [(tokens, (cfg.n_heads // tp + 2 * kv) * d, h), (tokens, h, cfg.n_heads * d // tp)]
        if mlp:
            gemms += [(tokens, (cfg.mlp_matrices - 1) * mlp, h), (tokens, h, mlp)]
        routed_flops = 2 * cfg.mlp_matrices * h * cfg.expert_ffn * cfg.top_k * tokens / tp if cfg.is_moe else 0.0
        lin_f = (layer_fwd - routed_flops) / (peak * _weighted_eff(gemms, ab, hw, dk))
        if fw.float8_linears:  # the block's linears in float8 (the output layer stays bf16), plus the scale casts
            lin_f /= dk.fp8_gemm_speedup
        lin_f += routed_expert_seconds(cfg, tokens, lay, fw, hw, dk, moe_imbalance)  # bf16 grouped GEMMs
        lin_b = 2 * lin_f
        hbm = hw.hbm_gbps * 1e9 * dk.hbm_efficiency
        if fw.float8_linears:
            cast = FLOAT8_CAST_BYTES * sum(m * k for m, _, k in gemms) / hbm
            lin_f += cast
            lin_b += FLOAT8_CAST_BYTES * sum(m * n for m, n, _ in gemms) / hbm
        attn_f, attn_b = attention_seconds(attn_fwd, d, kernel_seq, fw, hw, dk, peak)
        elementwise = elementwise_bytes(cfg, tokens, tp, lay.sp, fw) / hbm
        kernels = fw.kernels_per_layer + len(gemms) + 1  # with the matmuls and the attention kernel
        oh_f = kernels * hw.kernel_overhead_us * 1e-6
        oh_b = kernels * hw.backward_overhead()
        head_gemm = _weighted_eff([(chunk, cfg.vocab_size / tp, h)], ab, hw, dk)
        head_f = head_fwd / (peak * head_gemm) + tokens * cfg.vocab_size / tp * fw.logits_bytes * 2 / hbm
        head_b = 2 * head_f
        oh_rerun = fw.kernels_per_layer * hw.kernel_overhead_us * 1e-6
    lin_rerun = 0.0
    if fw.selective_reruns == "policy" and lay.recompute == "selective":
        # each linear's forward: as measured, or (by kernel class) the block's linears' time by its share of the FLOPs
        flops = [m * n * k for m, n, k in shapes]
        forward = [t[0] for t in measured] if calibrated else [lin_f * f / sum(flops) for f in flops]
        lin_rerun = sum(t for t, again in zip(forward, selective_reruns_linear(cfg, fw, fw.fused_projections),
                                              strict=True) if again)
    return _BlockSeconds(lin_f, lin_b, attn_f, attn_b, elementwise, oh_f, oh_b, oh_rerun, lin_rerun, head_f, head_b,
                         hbm)


def _tp_comm(lay: Layout, fw: Framework, hw: Cluster, h: int, tokens: float, chunk: float, act: float,
             st: dict) -> tuple[float, float, float, float, float]:
    """Tensor parallel's seconds: a block's collectives per direction (2 all-reduces, or 2 all-gathers + 2
    reduce-scatters with sp), sequence parallel's backward-only extras (the norms' gradient all-reduces, and apart
    the column linears' input gathered again for their weight gradients), the embedding's and the loss input's,
    and the vocabulary-parallel loss's; all 0 without tp."""
    tp = lay.tp
    t_tp_b_extra = 0.0  # backward-only collectives of sequence parallel
    regather = 0.0  # where the weight gradients are computed (B, or a split schedule's W)
    if tp > 1:
        if lay.sp:
            t_tp = 2 * (comm.all_gather(act, tp, st["tp"], hw) + comm.reduce_scatter(act, tp, st["tp"], hw))
            if fw.sp_regather_exposed:  # the column linears gather their input again for the weight gradients
                regather = 2 * comm.all_gather(act, tp, st["tp"], hw)
            # norm weights that see a sequence slice: their gradients all-reduced over tp, per block
            t_tp_b_extra += fw.sp_norm_grad_allreduces * comm.all_reduce(h * 4, tp, st["tp"], hw)
            # the embedding's output scattered, the loss's input gathered (and the reverse in backward)
            head_tp = comm.reduce_scatter(act, tp, st["tp"], hw) + comm.all_gather(act, tp, st["tp"], hw)
        else:
            t_tp = 2 * comm.all_reduce(act, tp, st["tp"], hw)
            head_tp = comm.all_reduce(act, tp, st["tp"], hw)  # the embedding's output; the loss's input grad
        t_tp *= (1 - fw.tp_overlap) / (tp if fw.async_tp else 1)
        t_tp_b_extra *= (1 - fw.tp_overlap) / (tp if fw.async_tp else 1)
        regather *= (1 - fw.tp_overlap) / (tp if fw.async_tp else 1)
        head_tp *= 1 - fw.tp_overlap
        # the vocabulary-parallel loss: row maxima, then sum of exponentials and target logits, per chunk
        loss_tp = tokens / chunk * (comm.all_reduce(chunk * 4, tp, st["tp"], hw)
                                    + comm.all_reduce(2 * chunk * 4, tp, st["tp"], hw))
    else:
        t_tp = head_tp = loss_tp = 0.0
    return t_tp, t_tp_b_extra, regather, head_tp, loss_tp


def gathered_linear_groups(cfg: ModelConfig) -> int:
    """The groups of linears per block that gather their sequence-parallel input themselves
    (`tensor_comm.gather_linears`): q/k/v, and a dense MLP's gate/up (an MoE layer gathers with `gather_sequence`)."""
    return 1 if cfg.is_moe else 2


def column_linear_share(cfg: ModelConfig) -> float:
    """Those gathered linears' share of a block's linear FLOPs (`linear_shapes`): q, k, v, and a dense MLP's gate
    and up (o and down are row-parallel; an MoE layer's linears do not gather their input themselves)."""
    flops = [m * n * k for m, n, k in linear_shapes(cfg, 1.0, 1, False)]
    gathered = flops[:3] + (flops[4:4 + cfg.mlp_matrices - 1] if gathered_linear_groups(cfg) == 2 else [])
    return sum(gathered) / sum(flops)


def row_linear_share(cfg: ModelConfig) -> float:
    """The share of a block's linear FLOPs (`linear_shapes`) of the row-parallel linears that reduce-scatter their
    output themselves under the overlap (`tensor_comm.linear_scatter`): o, and a dense MLP's down (an MoE layer
    leaves its region with `scatter_sequence`)."""
    flops = [m * n * k for m, n, k in linear_shapes(cfg, 1.0, 1, False)]
    fused = flops[3:4] + (flops[-1:] if gathered_linear_groups(cfg) == 2 else [])
    return sum(fused) / sum(flops)


def hidden_behind(comm_time: float, compute_time: float, overlap: float) -> float:
    """What running `compute_time` of compute beside a collective takes off it (`exposed` minus the collective's
    time), <= 0."""
    return exposed(comm_time, compute_time, overlap) - comm_time


def tp_forward_hidden(cfg: ModelConfig, lay: Layout, fw: Framework, hw: Cluster, act: float, lin_f: float,
                      st: dict) -> float:
    """What fivefold's tensor-parallel overlap (`layout.tp_comm_overlap`, sequence parallel) takes off a block's
    forward, <= 0: the gathered linears' input all-gather under their own rows' matmuls (1/tp of them), and the row
    linears' reduce-scatter in `SCATTER_PIECES` pieces, each but the last under the next piece's matmul (where the
    row linears are fused: not under a split backward), each hidden as far as the matmuls last and the device
    overlaps (`exposed`). Not under torch.compile, whose graph holds the forward's collectives in order
    (`tensor_comm`)."""
    if not runs_tp_overlap(lay, fw) or fw.compiled:
        return 0.0
    tp, groups, pieces = lay.tp, gathered_linear_groups(cfg), SCATTER_PIECES
    gather = groups * comm.all_gather(act, tp, st["tp"], hw)
    scatter = groups * comm.reduce_scatter(act, tp, st["tp"], hw) * (pieces - 1) / pieces \
        if fuses_row_linears(lay, fw) else 0.0
    own_rows = lin_f * column_linear_share(cfg) / tp
    next_pieces = lin_f * row_linear_share(cfg) * (pieces - 1) / pieces
    return hidden_behind(gather, own_rows, hw.comm_overlap) + hidden_behind(scatter, next_pieces, hw.comm_overlap)


def tp_backward_overlapped(lay: Layout, fw: Framework) -> bool:
    """fivefold's gathered linears run the overlapped backward (`layout.tp_comm_overlap` with sp), where they compute
    their weight gradients in it (not under a split backward, zero-bubble or DualPipeV, whose W pass does)."""
    return runs_tp_overlap(lay, fw) and not splits_backward(lay)


def tp_backward_hidden(cfg: ModelConfig, lay: Layout, fw: Framework, hw: Cluster, act: float, lin_b: float,
                       st: dict) -> float:
    """What fivefold's tensor-parallel overlap (`layout.tp_comm_overlap`, sequence parallel, a backward that computes
    its weight gradients) takes off a block's backward, <= 0: the gathered linears' (q/k/v, gate/up) input
    all-gather under their input-gradient matmuls and their input gradient's reduce-scatter under their
    weight-gradient matmuls, and the row linears' (o, down) output-gradient all-gather under their own rows' input
    and weight gradients (1/tp of them, not under torch.compile), each hidden as far as the matmuls last and the
    device overlaps (`exposed`)."""
    if not tp_backward_overlapped(lay, fw):
        return 0.0
    tp, groups = lay.tp, gathered_linear_groups(cfg)
    matmuls = lin_b / 2 * column_linear_share(cfg)  # each half: input gradient, weight gradient
    gather = groups * comm.all_gather(act, tp, st["tp"], hw) if fw.sp_regather_exposed else 0.0
    scatter = groups * comm.reduce_scatter(act, tp, st["tp"], hw)
    # the row linears' output-gradient all-gather, under their own rows' input and weight gradients
    row_gather = groups * comm.all_gather(act, tp, st["tp"], hw) if fuses_row_linears(lay, fw) else 0.0
    own_rows = lin_b * row_linear_share(cfg) / tp
    return (hidden_behind(gather, matmuls, hw.comm_overlap) + hidden_behind(scatter, matmuls, hw.comm_overlap)
            + hidden_behind(row_gather, own_rows, hw.comm_overlap))


def stage_times(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, hw: Cluster,
                docs: DocumentLengths | None = None, moe_imbalance: float = 1.0) -> StageTimes:
    h, d, tp = cfg.hidden, cfg.head_dim, lay.tp
    ab = fw.act_bytes
    tokens = lay.micro_batch_size * seq / lay.cp
    kv = max(cfg.n_kv_heads // tp, 1)
    # tokens per chunk of the fused output layer + loss (the whole micro-batch for unfused logits), as memory.py
    chunk = min(fw.tp_loss_chunk if tp > 1 else fw.fused_loss_chunk, tokens) if fw.fused_loss_chunk else tokens
    lin_f, lin_b, attn_f, attn_b, elementwise, oh_f, oh_b, oh_rerun, lin_rerun, head_f, head_b, hbm = _block_seconds(
        cfg, seq, lay, fw, hw, tokens, chunk, docs, moe_imbalance)
    t_layer = lin_f + attn_f + elementwise + oh_f
    # tensor parallel: 2 all-reduces (or 2 all-gathers + 2 reduce-scatters with sp) per block and direction
    act = tokens * h * ab
    st = comm.strides(lay)
    t_tp, t_tp_b_extra, regather, head_tp, loss_tp = _tp_comm(lay, fw, hw, h, tokens, chunk, act, st)
    # the column linears' input gathered again for their weight gradients: in a split schedule's W pass (which
    # computes them: `pipeline.WeightGradQueue`), else in the backward
    t_tp_w = regather if splits_backward(lay) else 0.0
    t_tp_b_extra += regather - t_tp_w
    t_cp_f, t_cp_b = _cp_comm(lay, hw, tokens * 2 * kv * d * ab, ab, attn_f, attn_b, st)
    t_ep = _ep_comm(cfg, lay, hw, tokens, h * ab, moe_imbalance)
    # whole experts under tp without sp: the tp ranks' routed outputs all-gathered along the sequence (forward only)
    if cfg.is_moe and lay.splits_tokens_over_tp and not lay.sp:
        t_tp_f_extra = comm.all_gather(tokens * h * ab, tp, st["tp"], hw) * (1 - fw.tp_overlap)
    else:
        t_tp_f_extra = 0.0
    t_tp_f = t_tp + tp_forward_hidden(cfg, lay, fw, hw, act, lin_f, st)
    # selective recompute reruns (`Framework.selective_reruns`) the attention core, which under cp is the ring's
    # forward with its transfers (fivefold keeps the ring's result instead: `keeps_ring`), or what the policy does not
    # keep; full recompute reruns everything
    ring_again = lay.recompute == "full" or lay.recompute == "selective" and not keeps_ring(lay, fw)
    policy = fw.selective_reruns == "policy"
    # the policy's rerun: the element-wise work with its fixed costs, the matmuls it does not keep, the per-operator
    # dispatch of the checkpoint's policy (a calibrated host time; none under torch.compile, which applies the policy
    # when it traces the block), and the tensor-parallel collectives except where the overlapped linears keep their
    # outputs (`tensor_comm.CollectiveStore`)
    tp_again = policy and lay.recompute == "selective" and tp > 1 and not runs_tp_overlap(lay, fw)
    dispatch = 0.0 if fw.compiled else hw.selective_dispatch_us * 1e-6
    rerun = elementwise + oh_rerun + lin_rerun + dispatch if policy else attn_f  # its compute
    recompute = {"none": 0.0, "selective": rerun + tp_again * (t_tp_f + t_tp_f_extra) + ring_again * t_cp_f,
                 "full": t_layer + t_tp_f + t_tp_f_extra + t_cp_f + t_ep}[lay.recompute]
    f_layer = t_layer + t_tp_f + t_tp_f_extra + t_cp_f + t_ep
    t_tp_b = t_tp + t_tp_b_extra + tp_backward_hidden(cfg, lay, fw, hw, act, lin_b, st)
    # backward: the linears' input-gradient half in B, weight-gradient half in W; a third of the fixed costs in W
    b_layer = lin_b / 2 + attn_b + elementwise + oh_b * 2 / 3 + t_tp_b + t_cp_b + t_ep + recompute
    w_layer = lin_b / 2 + elementwise + oh_b / 3 + t_tp_w  # (by kernel class: the backward's element-wise is B's
    # + W's share)
    counts = framework_stage_layers(cfg, lay, seq, fw)
    f = [n * f_layer for n in counts]
    b = [n * b_layer for n in counts]
    w = [n * w_layer for n in counts]
    f[0] += head_tp / 2
    b[0] += head_tp / 2
    f[-1] += head_f + loss_tp
    b[-1] += head_b / 2
    w[-1] += head_b / 2
    for s, seconds in enumerate(_grad_accum_copy(cfg, lay, fw, counts, hbm)):
        w[s] += seconds
    host = host_floor(cfg, lay, fw, hw, counts, f, b, w)
    comm_f = [n * (t_tp_f + t_tp_f_extra + t_cp_f + t_ep) for n in counts]
    comm_b = [n * (t_tp_b + t_cp_b + t_ep) for n in counts]
    comm_w = [n * t_tp_w for n in counts]
    comm_f[0] += head_tp / 2
    comm_b[0] += head_tp / 2
    comm_f[-1] += loss_tp
    again = 1 if lay.recompute == "full" else 0  # full recompute repeats the forward's communication
    tp_rerun = again or tp_again
    per_layer = {"tp_comm": (1 + tp_rerun) * t_tp_f + t_tp_b + t_tp_w + (1 + tp_rerun) * t_tp_f_extra,
                 "cp_comm": (1 + ring_again) * t_cp_f + t_cp_b,
                 "ep_comm": (2 + again) * t_ep,
                 # the recomputed forward's own compute (its communication is counted above)
                 "recompute": {"none": 0.0, "selective": rerun, "full": t_layer}[lay.recompute]}
    after_send = [min(lin_b / 2, w[s]) for s in range(len(counts))] if sends_before_weight_grads(lay, fw) else []
    return StageTimes(f, b, w, per_layer, counts, {"tp_comm": head_tp + loss_tp}, host, comm_f, comm_b, comm_w,
                      after_send)


def _cp_comm(lay: Layout, hw: Cluster, kv_bytes: float, ab: int, attn_f: float, attn_b: float,
             st: dict) -> tuple[float, float]:
    """Context parallel's exposed seconds per block, forward and backward: K/V blocks (`kv_bytes` of a micro-batch)
    around the ring, overlapped with the attention of the current block; the backward passes K/V around again
    (cp - 1 hops) and the fp32 dK/dV of each shard home (cp hops)."""
    if lay.cp <= 1:
        return 0.0, 0.0
    ring = (lay.cp - 1) * comm.send_recv(kv_bytes * 2, st["cp"], hw)
    grad_ring = lay.cp * comm.send_recv(kv_bytes / ab * 4 * 2, st["cp"], hw)
    # hidden behind the blocks' attention in proportion to the measured overlap (none where the same cores
    # compute and communicate)
    t_f = exposed(ring, attn_f, hw.comm_overlap)
    t_b = exposed(ring + grad_ring, attn_b, hw.comm_overlap)
    # each shift is posted before compute and waited for after it: what that costs beyond both, as measured
    wait = hw.posted_p2p_wait_us * 1e-6
    return t_f + (lay.cp - 1) * wait, t_b + (2 * lay.cp - 1) * wait


def _ep_comm(cfg: ModelConfig, lay: Layout, hw: Cluster, tokens: float, token_bytes: float,
             moe_imbalance: float) -> float:
    """Expert parallel's seconds per block and pass: dispatch and combine all-to-alls over the ep group (consecutive
    members of a dp x cp group), not overlapped, priced by the nodes the group spans (`comm.ep_group_nodes`); each
    rank sends the slots of the tokens it routes (all of them, or its 1/tp with whole experts), the busiest rank
    receiving its load."""
    if not (cfg.is_moe and lay.ep > 1):
        return 0.0
    slots = routed_tokens(tokens, lay) * cfg.top_k * busiest_rank_load(cfg, lay.ep, moe_imbalance)
    return 2 * comm.expert_all_to_all(slots * token_bytes, lay.ep, comm.ep_group_nodes(lay, hw.gpus_per_node), hw)


def _grad_accum_copy(cfg: ModelConfig, lay: Layout, fw: Framework, counts: list[int], hbm: float) -> list[float]:
    """Seconds per stage of the framework's gradient accumulation after each micro-batch's backward (its
    `grad_accum_copy_bytes` per parameter of the stage at `hbm` bytes/s; none where it has none)."""
    if not (fw.grad_accum_copy_bytes and lay.fp32_grad_accum):
        return [0.0] * len(counts)
    lp = layer_params(cfg, lay.tp, lay.ep, lay.etp)
    per_block = lp["sharded"] + lp["replicated"] + lp["expert"]
    table = cfg.vocab_size // lay.tp * cfg.hidden
    out = []
    for s, n in enumerate(counts):
        params = n * per_block + (table if s == 0 else 0) + (table if s == len(counts) - 1
                                                               and not (cfg.tied_embeddings and s == 0) else 0)
        out.append(params * fw.grad_accum_copy_bytes / hbm)
    return out


def sends_before_weight_grads(lay: Layout, fw: Framework) -> bool:
    """fivefold's pipeline sends each backward's input gradient before the stage's first block's weight gradients
    (`layout.pp_comm_overlap`, on by default; `train.build.weight_grad_queue`): not under ZeRO-3, and not in a
    schedule that splits the backward (whose W passes are deferred anyway)."""
    return bool(fw.layout_dp_options) and lay.overlaps_pp_comm and lay.zero < 3 and not splits_backward(lay)


def host_us_per_block(lay: Layout, fw: Framework, hw: Cluster) -> float:
    """Host time (µs) that one block's forward and backward take per micro-batch: the framework's eager work
    (`Framework.host_us_per_layer`), plus, when the pipeline's hand-overs cross nodes, what each tensor-parallel
    rank adds per block (`Framework.cross_node_pp_us_per_layer_tp`)."""
    us = fw.host_us_per_layer
    if lay.pp > 1 and lay.world_size > hw.gpus_per_node:  # pp is the outermost axis: its hand-overs leave the node
        us += fw.cross_node_pp_us_per_layer_tp * lay.tp
    return us


def host_floor(cfg: ModelConfig, lay: Layout, fw: Framework, hw: Cluster, counts: list[int], f: list[float],
               b: list[float], w: list[float]) -> list[float]:
    """Stretch each stage whose GPU work per micro-batch is shorter than the host time to issue it (the GPU
    then waits for the host); returns the seconds added per stage and micro-batch."""
    per_block = host_us_per_block(lay, fw, hw) * 1e-6
    added = [0.0] * len(f)
    if per_block <= 0:
        return added
    for s, n in enumerate(counts):
        gpu = f[s] + b[s] + w[s]
        host = n * per_block
        if host > gpu > 0:
            k = host / gpu
            f[s], b[s], w[s] = f[s] * k, b[s] * k, w[s] * k
            added[s] = host - gpu
    return added


def framework_stage_layers(cfg: ModelConfig, lay: Layout, seq: int, fw: Framework) -> list[int]:
    """Blocks per global pipeline stage as the framework splits them (`Framework.stage_split`): nanotron's own
    split, or the balanced one of `memory.stage_layers` (which the memory model uses for every framework)."""
    if fw.stage_split == "params" and lay.pp > 1 and lay.vpp == 1 and lay.schedule != "dualpipev":
        split = params_stage_split(cfg, lay.pp)
        if split is not None:
            return split[0]
    return stage_layers(cfg, lay, seq)


def params_stage_split(cfg: ModelConfig, pp: int) -> tuple[list[int], int] | None:
    """nanotron's split (`build_model`): the pipeline blocks (embedding, the blocks, final norm, output layer,
    cast, loss) in model order, each placed on the current rank, which hands over to the next once the cumulative
    parameter cost (a block 4 heads d h + 3 ffn h (2 for GELU), the output layer V h, the rest 0) passes its share
    (rank r: (r + 1) / pp of the total). Returns the blocks per rank and how many ranks hold some pipeline block,
    or None when the blocks run past the last rank."""
    block = 4 * cfg.n_heads * cfg.head_dim * cfg.hidden + cfg.mlp_matrices * cfg.ffn * cfg.hidden
    costs = [0] + [block] * cfg.n_layers + [0, cfg.vocab_size * cfg.hidden, 0, 0]
    total = sum(costs)
    counts, used = [0] * pp, set()
    rank, cumulative = 0, 0
    for i, cost in enumerate(costs):
        if rank >= pp:
            return None
        used.add(rank)
        if 1 <= i <= cfg.n_layers:
            counts[rank] += 1
        cumulative += cost
        if cumulative > total * (rank + 1) / pp:
            rank += 1
    return counts, len(used)


def stage_split_problem(cfg: ModelConfig, lay: Layout, fw: Framework) -> str | None:
    """Why the framework's own split cannot place this pipeline, or None: a rank that nanotron's split leaves
    without any pipeline block has nothing to train and the run fails (all 65 such playbook runs but one)."""
    if fw.stage_split != "params" or lay.pp <= 1 or lay.pp > cfg.n_layers:
        return None
    split = params_stage_split(cfg, lay.pp)
    if split is None or split[1] < lay.pp:
        return (f"pp = {lay.pp}: nanotron's split of the {cfg.n_layers} blocks and the output layer by parameter "
                "cost leaves a pipeline rank without any block")
    return None


def fb_pair_seconds(f: float, b: float, comm_f: float, comm_b: float, overlap: float) -> float:
    """A DualPipeV pair's time when its forward (`f`, of which `comm_f` is exposed collectives) and backward (`b`,
    with its W where the pair runs it, `Schedule.unit`; `comm_b`) run as two lanes (`parallel.lanes`): each lane's
    collectives hidden behind the other's compute as far as it lasts and the device overlaps (`exposed`)."""
    return (f + b + hidden_behind(comm_f, max(b - comm_b, 0.0), overlap)
            + hidden_behind(comm_b, max(f - comm_f, 0.0), overlap))


@lru_cache(maxsize=4096)
def _simulated(schedule: str, p: int, m: int, v: int, f: tuple, b: tuple, w: tuple, p2p: float,
               fb: tuple | None = None, after_send: tuple = ()) -> float:
    """`fb`: (comm_f, comm_b, comm_w, overlap, pair_w) where DualPipeV's F/B pairs run as two lanes
    (`fb_pair_seconds`; `pair_w`: with the B's W in the backward's lane, `Schedule.unit`); `after_send`: per stage,
    the backward's part after its input gradient left (`StageTimes.after_send`)."""
    sched = build_schedule(schedule, p, m, v if schedule == "interleaved" else 1, overlap_fb=fb is not None,
                           pair_w=fb is not None and fb[-1])
    pair = None
    if fb is not None:
        comm_f, comm_b, comm_w, overlap, _ = fb

        def pair(fwd, bwd, wgt=None) -> float:  # the B's lane runs its W too where that follows (`Schedule.unit`)
            s, whole = bwd.stage, wgt is not None
            return fb_pair_seconds(f[fwd.stage], b[s] + whole * w[s], comm_f[fwd.stage], comm_b[s] + whole * comm_w[s],
                                   overlap)
    return simulate(sched, list(f), list(b), list(w), p2p, pair_seconds=pair,
                    t_after_send=list(after_send) or 0.0).makespan


def runs_fb_overlap(lay: Layout, fw: Framework) -> bool:
    """fivefold's engine runs DualPipeV's F/B pairs as two lanes (`LayoutConfig.overlaps_fb`)."""
    return bool(fw.layout_dp_options) and lay.overlaps_fb


def pipeline_makespan(lay: Layout, times: StageTimes, p2p: float, exact: bool, fb_overlap: float | None = None
                      ) -> float:
    """Forward/backward time of all micro-batches: simulated with the schedule's action list when `exact`,
    else the closed form (used to rank thousands of candidates before simulating the best). `fb_overlap`: the
    device's overlap where DualPipeV's F/B pairs run as two lanes (`fb_pair_seconds`; the closed form takes what
    each rank's pairs hide off its busy time)."""
    m = lay.grad_accum_steps
    if lay.pp == 1:
        return m * (times.f[0] + times.b[0] + times.w[0])
    if exact and m * len(times.f) <= EXACT_MAX_ACTIONS:
        key = tuple(round(x, 9) for x in times.f), tuple(round(x, 9) for x in times.b), tuple(round(x, 9) for x in
                                                                                          times.w)
        fb = None
        if fb_overlap is not None and times.comm_f:
            fb = (*(tuple(round(x, 9) for x in c) for c in (times.comm_f, times.comm_b, times.comm_w)),
                  round(fb_overlap, 6), lay.fb_pairs_run_w)
        return _simulated(lay.schedule, lay.pp, m, lay.vpp, *key, round(p2p, 9), fb,
                          tuple(round(x, 9) for x in times.after_send))
    p = lay.pp
    n_stages = len(times.f)
    per_rank = [0.0] * p
    for s in range(n_stages):
        per_rank[_rank_of(s, lay)] += m * (times.f[s] + times.b[s] + times.w[s])
    if fb_overlap is not None and times.comm_f:
        for r, pairs in enumerate(_fused_stages(lay.pp, m, lay.fb_pairs_run_w)):
            for (sf, sb, whole), count in pairs:
                f, b = times.f[sf], times.b[sb] + whole * times.w[sb]
                comm_b = times.comm_b[sb] + whole * times.comm_w[sb]
                per_rank[r] -= count * (f + b - fb_pair_seconds(f, b, times.comm_f[sf], comm_b, fb_overlap))
    full = sum(times.f[s] + times.b[s] + times.w[s] for s in range(n_stages)) / n_stages  # one stage, one mb
    if lay.schedule in ("zero-bubble", "dualpipev"):  # W passes fill the bubble: (p-1)(F + B - 2W) per stage
        bubble = (p - 1) * max(full - 2 * sum(times.w) / n_stages, sum(times.f) / n_stages)
    else:  # (p-1)/m of the work, or (p-1)/(v m) for interleaved (whose stages are 1/v of a rank's layers); the
        # backward's hand-over leaves before what runs after its send (`StageTimes.after_send`)
        bubble = (p - 1) * (full - sum(times.after_send) / n_stages)
    sends = 2 * (p - 1) * (lay.vpp if lay.schedule == "interleaved" else 1)
    return max(per_rank) + bubble + sends * p2p


@lru_cache(maxsize=256)
def _fused_stages(p: int, m: int, pair_w: bool) -> tuple[tuple[tuple[tuple[int, int, bool], int], ...], ...]:
    """Per pp rank, each kind of DualPipeV's fused pairs in a step, (F stage, B stage, whether the B's W runs in
    the pair), with how many of them the rank runs."""
    sched = build_schedule("dualpipev", p, m, overlap_fb=True, pair_w=pair_w)
    out = []
    for r, (acts, ks) in enumerate(zip(sched.actions, sched.fused, strict=True)):
        fused = frozenset(ks)
        kinds = Counter((acts[k].stage, acts[k + 1].stage, len(sched.unit(r, k, fused)) == 3) for k in ks)
        out.append(tuple(sorted(kinds.items())))
    return tuple(out)


@dataclass
class TimeReport:
    step_time: float
    parts: dict[str, float]


def fsdp_link_time(gather: float, scatter: float, f_block: float, b_block: float, blocks: int, micro_batches: int,
                   overlap: float) -> float:
    """Exposed seconds of ZeRO-3's per-block collectives in a step without a pipeline, where they share one link
    (one communicator: its collectives run one after the other in issue order): each block's parameters gathered
    one block ahead in the forward and again in the backward (`gather` seconds each), its gradients
    reduce-scattered as its backward ends (`scatter`), against `f_block` and `b_block` seconds of compute per block.
    In the backward a block's compute hides the next block's gather and its own gradients' reduce-scatter together,
    not each alone; what a micro-batch leaves queued delays the next one's first gathers, and the step ends when the
    last reduce-scatter does. `overlap`: the share of that link time compute can hide (1 on GPUs; as `exposed`)."""
    link_total = micro_batches * blocks * (2 * gather + scatter)
    if link_total <= 0:
        return 0.0
    compute, link = 0.0, 0.0

    def send(issued: float, seconds: float) -> float:
        nonlocal link
        link = max(link, issued) + seconds
        return link

    ends = []
    for _ in range(min(micro_batches, 3)):  # the steady state repeats from the second micro-batch on
        ready = send(compute, gather)  # the first block's gather
        for i in range(blocks):
            start = max(compute, ready)
            if i + 1 < blocks:
                ready = send(start, gather)  # the next block's, under this block's compute
            compute = start + f_block
        ready = send(compute, gather)  # the backward gathers again, from the last block down
        for i in range(blocks):
            start = max(compute, ready)
            if i + 1 < blocks:
                ready = send(start, gather)
            compute = start + b_block
            send(compute, scatter)  # this block's gradients
        ends.append(max(compute, link))
    end = ends[-1] + (micro_batches - len(ends)) * (ends[-1] - ends[-2] if len(ends) > 1 else ends[-1])
    hidden_none = end - micro_batches * blocks * (f_block + b_block)
    return overlap * max(0.0, hidden_none) + (1 - overlap) * link_total


def _gather_time(cfg: ModelConfig, lay: Layout, fw: Framework, hw: Cluster, times: StageTimes, rp: RankParams,
                 states: dict, st: dict) -> float:
    """Exposed seconds of ZeRO's parameter all-gathers in a step: ZeRO-1/2's after the optimizer step where the
    framework exposes it, ZeRO-3's per block (one block ahead) with each unit's fixed cost; 0 without dp x cp."""
    dpc = lay.dp * lay.cp
    overlap = hw.comm_overlap
    param_full = states["parameters"] * (lay.zero_group if lay.zero >= 3 else 1)
    t_gather = 0.0
    if dpc > 1 and 1 <= lay.zero <= 2:
        t_gather = comm.all_gather(param_full / fw.param_bytes * min(fw.param_bytes, 2), dpc, st["dpcp"], hw)
        if fw.layout_dp_options and lay.overlaps_param_gather:
            # under the next step's first forward, bucket by bucket: exposed where it outlasts that forward
            t_gather = exposed(t_gather, times.f[0], overlap)
        elif not fw.layout_dp_options and not fw.zero1_allgather_exposed:
            t_gather = 0.0
    if dpc > 1 and lay.zero >= 3:  # gathered one block ahead: exposed where a block's gather outlasts its compute
        n_layers = max(1, -(-cfg.n_layers // lay.pp))
        if lay.pp > 1:  # gathered once per step (the weights stay gathered), a block's gather under its compute
            # (interleaved: a stage holds 1/v of the rank's blocks)
            per_block = (times.f[0] + times.b[0] + times.w[0]) / max(1, times.counts[0])
            t_gather = n_layers * exposed(zero3_block_gather(cfg, lay, fw, hw, rp, st), per_block / 3, overlap)
        # without a pipeline the gathers share the link with the reduce-scatters: `step_time`, `fsdp_link_time`
        # what each unit (the blocks and the root) costs per micro-batch beyond its collectives, as measured
        units = n_layers + 1
        if lay.experts_apart and cfg.is_moe:  # per MoE layer: the router's unit, the shared experts', the experts'
            units += n_layers * (1 + (cfg.n_shared_experts > 0) + (lay.edp > 1))
        t_gather += lay.grad_accum_steps * units * hw.zero3_unit_us * 1e-6
    return t_gather


def zero3_block_gather(cfg: ModelConfig, lay: Layout, fw: Framework, hw: Cluster, rp: RankParams, st: dict) -> float:
    """Seconds of ZeRO-3's all-gather of one block's parameters, as gathered (`Framework.gather_bytes`)."""
    n_layers = max(1, -(-cfg.n_layers // lay.pp))
    gathered = fw.gather_bytes or fw.param_bytes
    zg = lay.zero_group  # the ranks ZeRO-3 gathers over: dp x cp, or HSDP's shard group
    if lay.experts_apart and cfg.is_moe:  # the routed experts are units of their own over the edp ranks
        # holding the same experts (`parallel.data.FullyShardedDataParallel`); with edp = 1 they stay whole
        ag = comm.all_gather(rp.dense * gathered / n_layers, zg, st["dpcp"], hw)
        if lay.expert_zero_group > 1:  # over the ranks of the shard group that hold the same experts
            stride = lay.ep if lay.splits_tokens_over_tp else st["dpcp"] * lay.ep
            ag += comm.all_gather(rp.expert * gathered / n_layers, lay.expert_zero_group, stride, hw)
        return ag
    return comm.all_gather(rp.total * gathered / n_layers, zg, st["dpcp"], hw)


def _data_parallel_time(cfg: ModelConfig, lay: Layout, fw: Framework, hw: Cluster, times: StageTimes,
                        rp: RankParams, states: dict, st: dict) -> tuple[float, float]:
    """(Exposed seconds of the gradient reduction, of ZeRO's parameter gathers) in a step. The reduction is
    bucketed, launched during the last micro-batch's backward: dense gradients over dp x cp, routed experts' over
    the ranks holding the same experts (dp x cp / ep, every ep-th member). ZeRO-3 without a pipeline runs its
    gathers and reduce-scatters on one link under the blocks' compute (`fsdp_link_time`)."""
    dpc = lay.dp * lay.cp
    elem_bytes = reduced_grad_bytes(lay, fw)
    red_bytes = rp.total * elem_bytes
    # the engine never splits a parameter over buckets, so a bucket below the mean tensor holds about one tensor
    bucket = max(dp_bucket_bytes(lay, fw, elem_bytes), red_bytes / parameter_tensors(cfg, rp.layers))
    overlap = hw.comm_overlap  # share of a collective that compute running at once can hide

    def reduce_time(nbytes: float, size: int, stride: int, shards: int, nodes: int = 0) -> float:
        """`size` ranks `stride` apart reduce `nbytes` (spanning `nodes` nodes where given); under ZeRO-3 the first
        `shards` of them hold one shard set (all of them, or HSDP's shard group), the rest its replicas."""
        nodes = nodes if shards == size else 0
        if lay.zero >= 3:  # ZeRO-3 reduce-scatters each unit's (block's) gradients as its backward ends
            unit = max(bucket, nbytes / max(1, -(-cfg.n_layers // lay.pp)))
            t = comm.reduce_scatter(nbytes, shards, stride, hw, unit, nodes)
            if size > shards:  # HSDP: then each shard is all-reduced over the replicas
                t += comm.all_reduce(nbytes / shards, size // shards, stride * shards, hw, unit / shards)
            # under pp only each stage's last backward of the step reduce-scatters (`parallel.pipeline_zero3`)
            return t * (1 if lay.pp > 1 else lay.grad_accum_steps)
        if lay.zero >= 2:  # ZeRO-2 keeps only a gradient shard, so every micro-batch reduce-scatters
            return comm.reduce_scatter(nbytes, size, stride, hw, bucket, nodes) * lay.grad_accum_steps
        return comm.all_reduce(nbytes, size, stride, hw, bucket, nodes)

    t_dp_exposed = 0.0
    t_gather = _gather_time(cfg, lay, fw, hw, times, rp, states, st)
    if dpc > 1:
        t_dp = reduce_time(rp.dense * elem_bytes, dpc, st["dpcp"], lay.zero_group)
        t_dp += reduce_time(rp.expert * elem_bytes, lay.edp, st["dpcp"] * lay.ep, lay.expert_zero_group,
                            edp_nodes(lay, hw.gpus_per_node))
        if lay.zero >= 3 and lay.pp == 1:
            # the gathers (forward and backward) and the reduce-scatters on one link, under the blocks' compute:
            # what the gathers alone leave exposed is theirs, the rest the reduction's
            blocks = max(1, times.counts[0])
            f_block, b_block = times.f[0] / blocks, (times.b[0] + times.w[0]) / blocks
            ag = zero3_block_gather(cfg, lay, fw, hw, rp, st)
            rs = t_dp / lay.grad_accum_steps / blocks
            link = [fsdp_link_time(ag, x, f_block, b_block, blocks, lay.grad_accum_steps, overlap)
                    for x in (0.0, rs)]
            t_gather += link[0]
            t_dp_exposed = link[1] - link[0]
        else:
            last_bucket = t_dp * min(1.0, bucket / max(red_bytes, 1.0))
            window = sum(times.b[s] + times.w[s] for s in range(len(times.f)) if _rank_of(s, lay) == 0) \
                if lay.pp > 1 else times.b[0] + times.w[0]
            if lay.zero == 2:  # every micro-batch reduce-scatters behind its own backward, not all behind the last
                window *= lay.grad_accum_steps
            t_dp_exposed = exposed(t_dp, window, overlap) + overlap * last_bucket
    if cfg.tied_embeddings and lay.pp > 1 and _rank_of(len(times.f) - 1, lay) != 0:
        # the embedding and the output layer on the first and last pipeline ranks: their reduced gradients are
        # summed over those two ranks after the step's backward, not overlapped
        tied = cfg.vocab_size / lay.tp * cfg.hidden * elem_bytes
        t_dp_exposed += comm.all_reduce(tied, 2, st["pp"] * (lay.pp - 1), hw)
    return t_dp_exposed, t_gather


def step_time(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, hw: Cluster, exact: bool = True,
              docs: DocumentLengths | None = None, moe_imbalance: float = 1.0) -> TimeReport:
    """`moe_imbalance`: the busiest expert's load over the even share (1: balanced routing)."""
    hw = hw.on_node(min(lay.world_size, hw.gpus_per_node))
    times = stage_times(cfg, seq, lay, fw, hw, docs, moe_imbalance)
    tokens = lay.micro_batch_size * seq / lay.cp
    # the residual stream crosses stages, in the framework's residual dtype (bf16 in fivefold's lean engine)
    send = tokens * cfg.hidden * fw.residual_bytes / (lay.tp if lay.sp else 1)
    p2p = comm.p2p(send, lay, hw) if lay.pp > 1 else 0.0
    fb = hw.comm_overlap if runs_fb_overlap(lay, fw) else None
    makespan = pipeline_makespan(lay, times, p2p, exact, fb)
    # what DualPipeV's overlapped pairs take off the plain schedule
    fb_hidden = pipeline_makespan(lay, times, p2p, exact) - makespan if fb is not None else 0.0
    per_rank = [0.0] * lay.pp
    for s in range(len(times.f)):
        per_rank[_rank_of(s, lay)] += times.f[s] + times.b[s] + times.w[s]
    ideal = lay.grad_accum_steps * max(per_rank)
    st = comm.strides(lay)
    states = model_state_bytes(cfg, lay, fw, "first", seq=seq)
    rp = rank_params(cfg, lay, "first", seq=seq)
    t_dp_exposed, t_gather = _data_parallel_time(cfg, lay, fw, hw, times, rp, states, st)
    # the optimizer step streams parameters, gradients and states once, plus a fixed cost per tensor
    opt_bandwidth = (hw.optimizer_gbps * 1e9 if hw.optimizer_gbps else hw.hbm_gbps * 1e9 / 2) / hw.compute_scale
    t_opt = (states["parameters"] + states["gradients"] + states["optimizer"]) / opt_bandwidth \
        + optimizer_tensors(cfg, lay, fw, seq) * hw.optimizer_tensor_us * 1e-6 * hw.compute_scale
    # blocking stage hand-overs across nodes: each micro-batch waits for the slowest rank of the job
    nodes = job_nodes(lay, hw)
    t_sync = lay.grad_accum_steps * hw.pp_sync_us_per_node * 1e-6 * nodes if lay.pp > 1 and nodes > 1 else 0.0
    makespan += t_sync
    total = (makespan + t_dp_exposed + t_gather + t_opt) * drift_factor(lay, hw)
    busiest = max(range(lay.pp), key=lambda r: per_rank[r])
    blocks = sum(n for s, n in enumerate(times.counts) if _rank_of(s, lay) == busiest)
    parts = {k: v * blocks * lay.grad_accum_steps for k, v in times.comm_per_layer.items()}
    for k, v in times.comm_per_micro_batch.items():
        parts[k] += v * lay.grad_accum_steps
    host_wait = lay.grad_accum_steps * sum(w for s, w in enumerate(times.host_wait) if _rank_of(s, lay) == busiest)
    parts["host_wait"] = host_wait
    parts = {"compute": ideal - sum(parts.values()), **parts}
    bubble = max(0.0, makespan + fb_hidden - t_sync - ideal)
    for k in ("tp_comm", "cp_comm", "ep_comm"):  # the pairs hide the stages' own collectives, then the bubble
        take = min(fb_hidden, parts.get(k, 0.0))
        if take > 0:
            parts[k] -= take
            fb_hidden -= take
    parts.update({"pipeline_bubble": max(0.0, bubble - fb_hidden), "pipeline_wait": t_sync,
                  "dp_comm_exposed": t_dp_exposed,
                  "zero_gather": t_gather, "optimizer": t_opt})
    # a cluster with drift data has the drift as a part (the parts of the others stay as they were)
    parts.update({"scale_drift": total - total / drift_factor(lay, hw)} if hw.drift_per_node_doubling else {})
    return TimeReport(total, parts)


def edp_nodes(lay: Layout, gpus_per_node: int) -> int:
    """Nodes an edp group (the ranks that reduce the same routed experts' gradients) spans: its members at one
    position of every ep block of a dp x cp group lie ep x tp ranks apart, and with whole experts (etp = 1) each
    brings its tp ranks along, which share its node (tp stays inside a node)."""
    return comm.nodes_spanned(max(lay.dp * lay.cp // lay.ep, 1), lay.ep * lay.tp, gpus_per_node)


def job_nodes(lay: Layout, hw: Cluster) -> int:
    return math.ceil(lay.world_size / hw.gpus_per_node)


def drift_factor(lay: Layout, hw: Cluster) -> float:
    """What multiplies a clean step on `job_nodes` nodes: (1 + `Cluster.drift_per_node_doubling`) per doubling of
    the nodes beyond one (each blocking collective waits for the slowest node of its ring or tree, and the
    expected lag of the slowest of n grows with log n); 1 on one node or without drift data."""
    nodes = job_nodes(lay, hw)
    return (1 + hw.drift_per_node_doubling) ** math.log2(nodes) if nodes > 1 else 1.0


@dataclass(frozen=True)
class StallRisk:
    """The chance that a step of a pipelined layout stalls at its stage hand-overs, and the seconds it then
    adds: every one of the step's 2 (m + p - 1) hand-overs (1F1B: m micro-batches, p stages, forward and backward)
    waits `per_handover` seconds. A two-point distribution: the step takes the clean time with chance
    1 - `probability`, the clean time + `added_s` otherwise."""

    probability: float = 0.0
    added_s: float = 0.0
    handovers: int = 0

    def quantile(self, clean_s: float, q: float) -> float:
        """The q-quantile of the step time: clean while at least a share q of steps is clean."""
        return clean_s if 1 - self.probability >= q else clean_s + self.added_s

    def expected(self, clean_s: float) -> float:
        return clean_s + self.probability * self.added_s


def stall_risk(lay: Layout, hw: Cluster) -> StallRisk:
    """`StallRisk` of a layout on a cluster: per-node hazard h (`Cluster.stall_hazard_per_node`), so a job of n
    nodes stalls with chance 1 - (1 - h)^n; each hand-over then waits `stall_s_per_handover` at pp = 2
    (`stall_s_per_handover_deep` at pp > 2), times (1 + g) per doubling of tp. No risk without a pipeline or
    without stall data."""
    if lay.pp <= 1 or not hw.stall_hazard_per_node:
        return StallRisk()
    probability = 1 - (1 - hw.stall_hazard_per_node) ** job_nodes(lay, hw)
    base = hw.stall_s_per_handover_deep if lay.pp > 2 and hw.stall_s_per_handover_deep else hw.stall_s_per_handover
    per_handover = base * (1 + hw.stall_growth_per_tp_doubling) ** math.log2(lay.tp)
    return StallRisk(probability, handovers(lay) * per_handover, handovers(lay))


def handovers(lay: Layout) -> int:
    """Stage hand-overs of a pipelined step in which every rank waits on its neighbour: 2 (m + p - 1), the
    forward's and the backward's (0 without a pipeline)."""
    return 2 * (lay.grad_accum_steps + lay.pp - 1) if lay.pp > 1 else 0


def optimizer_tensors(cfg: ModelConfig, lay: Layout, fw: Framework, seq: int) -> int:
    """Tensors the optimizer step walks on one rank: every parameter tensor of its stage, or under ZeRO-1/2
    one flat shard per gradient bucket (buckets split weights from norms, tp-sharded from replicated)."""
    if 1 <= lay.zero <= 2 and lay.dp * lay.cp > 1:
        grads = model_state_bytes(cfg, lay, fw, "first", seq=seq)["gradients"] * lay.dp * lay.cp
        classes = 2 if lay.tp == 1 else 4
        return classes + int(grads // dp_bucket_bytes(lay, fw, reduced_grad_bytes(lay, fw)))
    return parameter_tensors(cfg, rank_params(cfg, lay, "first", seq=seq).layers)


def parameter_tensors(cfg: ModelConfig, layers: int) -> int:
    """Parameter tensors of a rank holding `layers` blocks (`RankParams.layers`): a block's (norms, projections; an
    MoE layer's router and experts), the embedding, the final norm and an untied output layer."""
    per_layer = 9 if not cfg.is_moe else 6 + 4 + (3 if cfg.n_shared_experts else 0)
    return layers * per_layer + 2 + (0 if cfg.tied_embeddings else 1)


def _rank_of(stage: int, lay: Layout) -> int:
    p = lay.pp
    if lay.schedule == "dualpipev" and p > 1:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p
