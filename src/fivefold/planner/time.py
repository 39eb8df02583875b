"""Step time of a layout: compute at a shape-dependent efficiency, communication with its overlap, and the
pipeline schedule simulated action by action.

Compute FLOPs come from `fivefold.flops.training_flops_per_token`, the function the trainer logs MFU with;
only their speed depends on the shapes: each matmul of a block runs at `matmul_efficiency` of the peak scaled
down by the roofline (arithmetic intensity against the device's FLOP/byte ridge), plus memory-bound
element-wise work and a per-kernel launch cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from fivefold.config import ModelConfig
from fivefold.flops import training_flops_per_token
from fivefold.parallel.schedules import build_schedule, simulate
from fivefold.planner import comm
from fivefold.planner.hardware import Cluster
from fivefold.planner.layout import Framework, Layout
from fivefold.planner.memory import layer_activation_bytes, stage_layers

# schedules with more F actions than this are timed with the closed form (simulating them takes seconds)
EXACT_MAX_ACTIONS = 8192
KERNELS_PER_LAYER = 24  # launched kernels per block forward (norms, projections, rope, attention, MLP, adds)


def _gemm_eff(m: float, n: float, k: float, ab: int, hw: Cluster) -> float:
    intensity = 2 * m * n * k / (ab * (m * k + k * n + m * n))
    ridge = hw.peak_flops() / (hw.hbm_gbps * 1e9)
    return hw.matmul_efficiency * min(1.0, intensity / ridge)


def _weighted_eff(gemms: list[tuple[float, float, float]], ab: int, hw: Cluster) -> float:
    """Efficiency of a set of matmuls, weighted by their FLOPs (harmonic: times add up)."""
    flops = [m * n * k for m, n, k in gemms]
    time = sum(f / _gemm_eff(m, n, k, ab, hw) for f, (m, n, k) in zip(flops, gemms, strict=True))
    return sum(flops) / time


@dataclass
class StageTimes:
    f: list[float]  # forward per micro-batch, per global stage
    b: list[float]  # input-gradient backward (the whole backward minus W)
    w: list[float]  # weight-gradient pass
    comm_per_layer: dict[str, float] = field(default_factory=dict)  # exposed, per block and micro-batch
    counts: list[int] = field(default_factory=list)  # blocks per stage


def stage_times(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, hw: Cluster) -> StageTimes:
    h, d, tp = cfg.hidden, cfg.head_dim, lay.tp
    ab = fw.act_bytes
    tokens = lay.mbs * seq / lay.cp
    peak = hw.peak_flops(fw.compute_dtype)
    # FLOPs from the one formula: per layer and the output layer, forward only (one third of training)
    per_token = training_flops_per_token(cfg, seq)
    head_flops = 6 * cfg.vocab_size * h
    attn_flops = 6 * cfg.n_layers * seq * cfg.n_heads * d  # causal: half of 12 L s h
    layer_fwd = (per_token - head_flops - attn_flops) / cfg.n_layers / 3 * tokens / tp
    attn_fwd = attn_flops / cfg.n_layers / 3 * tokens / tp
    head_fwd = head_flops / 3 * tokens / tp
    kv = max(cfg.n_kv_heads // tp, 1)
    f_mlp = (cfg.expert_ffn * (cfg.top_k + cfg.n_shared_experts) if cfg.is_moe else cfg.ffn) // tp
    gemms = [(tokens, (cfg.n_heads // tp + 2 * kv) * d, h), (tokens, h, cfg.n_heads * d // tp),
             (tokens, 2 * f_mlp, h), (tokens, h, f_mlp)]
    eff = _weighted_eff(gemms, ab, hw)
    hbm = hw.hbm_gbps * 1e9
    elementwise = 2 * layer_activation_bytes(cfg, int(tokens), Layout(tp=tp, sp=lay.sp), fw)["total"] / hbm
    overhead = KERNELS_PER_LAYER * hw.kernel_overhead_us * 1e-6
    t_layer = layer_fwd / (peak * eff) + attn_fwd / (peak * hw.matmul_efficiency) + elementwise + overhead
    t_attn = attn_fwd / (peak * hw.matmul_efficiency)
    # tensor parallel: 2 all-reduces (or 2 all-gathers + 2 reduce-scatters with sp) per block and direction
    act = tokens * h * ab
    st = comm.strides(lay)
    if tp > 1:
        if lay.sp:
            t_tp = 2 * (comm.all_gather(act, tp, st["tp"], hw) + comm.reduce_scatter(act, tp, st["tp"], hw))
        else:
            t_tp = 2 * comm.all_reduce(act, tp, st["tp"], hw)
        t_tp *= 1 - fw.tp_overlap
    else:
        t_tp = 0.0
    # context parallel: K/V blocks around the ring, overlapped with the attention of the current block; the
    # backward passes K/V around again (cp - 1 hops) and the fp32 dK/dV of each shard home (cp hops)
    t_cp_f = t_cp_b = 0.0
    if lay.cp > 1:
        kv_bytes = tokens * 2 * kv * d * ab
        ring = (lay.cp - 1) * comm.all_to_all(kv_bytes * 2, 2, st["cp"], hw)
        grad_ring = lay.cp * comm.all_to_all(kv_bytes / ab * 4 * 2, 2, st["cp"], hw)
        t_cp_f = max(0.0, ring - t_attn)
        t_cp_b = max(0.0, ring + grad_ring - 2 * t_attn)
    # expert parallel: dispatch and combine all-to-alls over the ep group (consecutive members of a dp x cp
    # group), not overlapped
    t_ep = 0.0
    if cfg.is_moe and lay.ep > 1:
        t_ep = 2 * comm.all_to_all(tokens * cfg.top_k * h * ab, lay.ep, st["dpcp"], hw)
    # selective recompute reruns the attention core, which under cp is the ring's forward with its transfers
    recompute = {"none": 0.0, "selective": t_attn + t_cp_f, "full": t_layer + t_tp + t_cp_f + t_ep}[lay.recompute]
    f_layer = t_layer + t_tp + t_cp_f + t_ep
    # backward: twice the forward's matmuls, split evenly into input-gradient (B) and weight-gradient (W)
    w_layer = t_layer - t_attn - overhead / 2
    b_layer = t_layer + t_attn + t_tp + t_cp_b + t_ep + recompute
    head_gemm = _weighted_eff([(min(tokens, fw.fused_loss_chunk or tokens), cfg.vocab_size / tp, h)], ab, hw)
    t_head = head_fwd / (peak * head_gemm) + tokens * cfg.vocab_size / tp * fw.logits_bytes * 2 / hbm
    counts = stage_layers(cfg, lay, seq)
    f = [n * f_layer for n in counts]
    b = [n * b_layer for n in counts]
    w = [n * w_layer for n in counts]
    f[-1] += t_head
    b[-1] += t_head
    w[-1] += t_head
    again = 1 if lay.recompute == "full" else 0  # full recompute repeats the forward's communication
    again_cp = 1 if lay.recompute != "none" else 0  # selective recompute too (the ring is the recomputed core)
    per_layer = {"tp_comm": (2 + again) * t_tp, "cp_comm": (1 + again_cp) * t_cp_f + t_cp_b,
                 "ep_comm": (2 + again) * t_ep}
    return StageTimes(f, b, w, per_layer, counts)


@lru_cache(maxsize=4096)
def _simulated(schedule: str, p: int, m: int, v: int, f: tuple, b: tuple, w: tuple, p2p: float) -> float:
    sched = build_schedule(schedule, p, m, v if schedule == "interleaved" else 1)
    return simulate(sched, list(f), list(b), list(w), p2p).makespan


def pipeline_makespan(lay: Layout, times: StageTimes, p2p: float, exact: bool) -> float:
    """Forward/backward time of all micro-batches: simulated with the schedule's action list when `exact`,
    else the closed form (used to rank thousands of candidates before simulating the best)."""
    m = lay.grad_acc
    if lay.pp == 1:
        return m * (times.f[0] + times.b[0] + times.w[0])
    if exact and m * len(times.f) <= EXACT_MAX_ACTIONS:
        key = tuple(round(x, 9) for x in times.f), tuple(round(x, 9) for x in times.b), tuple(round(x, 9) for x in
                                                                                          times.w)
        return _simulated(lay.schedule, lay.pp, m, lay.vpp, *key, round(p2p, 9))
    p = lay.pp
    n_stages = len(times.f)
    per_rank = [0.0] * p
    for s in range(n_stages):
        per_rank[_rank_of(s, lay)] += times.f[s] + times.b[s] + times.w[s]
    full = sum(times.f[s] + times.b[s] + times.w[s] for s in range(n_stages)) / n_stages  # one stage, one mb
    if lay.schedule in ("zero-bubble", "dualpipev"):  # W passes fill the bubble: (p-1)(F + B - 2W) per stage
        bubble = (p - 1) * max(full - 2 * sum(times.w) / n_stages, sum(times.f) / n_stages)
    else:  # (p-1)/m of the work, or (p-1)/(v m) for interleaved (whose stages are 1/v of a rank's layers)
        bubble = (p - 1) * full
    sends = 2 * (p - 1) * (lay.vpp if lay.schedule == "interleaved" else 1)
    return m * max(per_rank) + bubble + sends * p2p


@dataclass
class TimeReport:
    step_time: float
    parts: dict[str, float]


def step_time(cfg: ModelConfig, seq: int, lay: Layout, fw: Framework, hw: Cluster, exact: bool = True) -> TimeReport:
    from fivefold.planner.memory import model_state_bytes, rank_params

    times = stage_times(cfg, seq, lay, fw, hw)
    tokens = lay.mbs * seq / lay.cp
    send = tokens * cfg.hidden * fw.act_bytes / (lay.tp if lay.sp else 1)
    p2p = comm.p2p(send, lay, hw) if lay.pp > 1 else 0.0
    makespan = pipeline_makespan(lay, times, p2p, exact)
    per_rank = [0.0] * lay.pp
    for s in range(len(times.f)):
        per_rank[_rank_of(s, lay)] += times.f[s] + times.b[s] + times.w[s]
    ideal = lay.grad_acc * max(per_rank)
    st = comm.strides(lay)
    states = model_state_bytes(cfg, lay, fw, "first")
    # gradient reduction, bucketed, launched during the last micro-batch's backward: dense gradients over
    # dp x cp, routed experts' over the ranks holding the same experts (dp x cp / ep, every ep-th member)
    dpc = lay.dp * lay.cp
    rp = rank_params(cfg, lay, "first")
    elem_bytes = fw.accum_bytes if lay.fp32_grad_accum else fw.grad_bytes
    red_bytes = (rp.dense + rp.expert) * elem_bytes
    bucket = fw.dp_bucket_mib * 2**20

    def reduce_time(nbytes: float, size: int, stride: int) -> float:
        if lay.zero >= 2:  # ZeRO-2/3 keep only a gradient shard, so every micro-batch reduce-scatters
            return comm.reduce_scatter(nbytes, size, stride, hw, bucket) * lay.grad_acc
        return comm.all_reduce(nbytes, size, stride, hw, bucket)

    t_dp = 0.0
    if dpc > 1:
        t_dp = reduce_time(rp.dense * elem_bytes, dpc, st["dpcp"])
        t_dp += reduce_time(rp.expert * elem_bytes, dpc // lay.ep, st["dpcp"] * lay.ep)
        last_bucket = t_dp * min(1.0, bucket / max(red_bytes, 1.0))
        window = sum(times.b[s] + times.w[s] for s in range(len(times.f)) if _rank_of(s, lay) == 0) if lay.pp > 1 \
            else times.b[0] + times.w[0]
        t_dp_exposed = max(0.0, t_dp - window) + last_bucket
    else:
        t_dp_exposed = 0.0
    param_full = states["parameters"] * (dpc if lay.zero >= 3 else 1)
    t_gather = 0.0
    if dpc > 1 and 1 <= lay.zero <= 2 and fw.zero1_allgather_exposed:
        t_gather = comm.all_gather(param_full / fw.param_bytes * min(fw.param_bytes, 2), dpc, st["dpcp"], hw)
    if dpc > 1 and lay.zero >= 3:  # gathered one block ahead: exposed where a block's gather outlasts its compute
        n_layers = max(1, -(-cfg.n_layers // lay.pp))
        block = param_full / n_layers
        ag = comm.all_gather(block, dpc, st["dpcp"], hw)
        per_block = (times.f[0] + times.b[0] + times.w[0]) / n_layers
        t_gather = lay.grad_acc * n_layers * 2 * max(0.0, ag - per_block / 3)
    hbm = hw.hbm_gbps * 1e9
    t_opt = 2 * (states["parameters"] + states["gradients"] + states["optimizer"]) / hbm  # read + write once
    total = makespan + t_dp_exposed + t_gather + t_opt
    busiest = max(range(lay.pp), key=lambda r: per_rank[r])
    blocks = sum(n for s, n in enumerate(times.counts) if _rank_of(s, lay) == busiest)
    parts = {k: v * blocks * lay.grad_acc for k, v in times.comm_per_layer.items()}
    parts = {"compute": ideal - sum(parts.values()), **parts}
    parts.update({"pipeline_bubble": max(0.0, makespan - ideal), "dp_comm_exposed": t_dp_exposed,
                  "zero_gather": t_gather, "optimizer": t_opt})
    return TimeReport(total, parts)


def _rank_of(stage: int, lay: Layout) -> int:
    p = lay.pp
    if lay.schedule == "dualpipev" and p > 1:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p
