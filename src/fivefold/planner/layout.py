"""A candidate layout (`fivefold train`'s `LayoutConfig` itself, with the gradient accumulation steps that the
global batch implies) and the framework settings that turn a layout into bytes and seconds.

`Framework` holds what differs between implementations of the same techniques, so that published runs of
another framework can be modelled with its own settings: the precision of parameters and gradients, whether
autocast keeps bf16 weight copies, whether tensor parallel is overlapped, and the fixed per-device memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import ConfigError, LayoutConfig, did_you_mean, shown
from fivefold.layout import (
    LOSS_CHUNK_TOKENS,
    SCHEDULES,
    TP_LOSS_CHUNK_TOKENS,
    batch_problem,
    communication_problem,
    hsdp_problem,
    raise_problem,
)

RECOMPUTE = ("none", "selective", "full")


@dataclass
class Layout(LayoutConfig):
    """A `LayoutConfig` (the same fields, so the planner and the trainer cannot drift apart) whose micro-batch
    size is explicit (1 unless given) and which carries the gradient accumulation steps of its global batch."""

    micro_batch_size: int = 1
    grad_accum_steps: int = 1

    @property
    def edp(self) -> int:
        """The ranks that hold the same routed experts and reduce their gradients: dp x cp / ep, times tp with whole
        experts on every tp rank (`layout.etp = 1` under tp, where each tp rank routes its own tokens;
        `parallel.mesh.expert_groups`)."""
        return max(self.dp * self.cp // self.ep, 1) * (self.tp if self.splits_tokens_over_tp else 1)

    def short(self) -> str:
        s = f"dp{self.dp} tp{self.tp}{'+sp' if self.sp and self.tp > 1 else ''} pp{self.pp}"
        if self.cp > 1:
            s += f" cp{self.cp}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.tp > 1 and self.etp > 1:  # experts split over tp (whole experts, etp = 1, is the default)
            s += f" etp{self.etp}"
        s += f" z{self.zero}" + (f" hsdp{self.dp_shard}" if self.dp_shard else "")
        s += f" mbs{self.micro_batch_size} ga{self.grad_accum_steps} rc:{self.recompute}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f" v{self.vpp}" if self.vpp > 1 else "")
        return s

    def to_dict(self) -> dict:
        """The fields, plus `mbs` and `grad_acc`: the previous names of micro_batch_size and grad_accum_steps,
        kept in `fivefold plan --json` for readers of the previous release (to be removed in the next one)."""
        d = dataclasses.asdict(self)
        return {**d, "mbs": self.micro_batch_size, "grad_acc": self.grad_accum_steps}

    def to_layout_config(self) -> LayoutConfig:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(LayoutConfig)}
        return LayoutConfig(**{**values, "stage_layers": list(self.stage_layers)})


# the previous names of two fields, still read from --layout
LEGACY_NAMES = {"mbs": "micro_batch_size", "grad_acc": "grad_accum_steps"}


_KEYS = {f.name for f in dataclasses.fields(LayoutConfig)} - {"stage_layers"} | {"mbs"}
_ON_OFF = {f.name for f in dataclasses.fields(LayoutConfig) if str(f.type).startswith("bool")}  # sp, switches


def check_runs_hsdp(lay: Layout, fw: Framework) -> None:
    """Refuse an HSDP layout for a framework that does not run HSDP (nanotron, megatron and deepspeed as
    modelled here; fivefold and torchtitan run it)."""
    if lay.dp_shard and not fw.hsdp:
        from fivefold.planner.profile import all_frameworks

        raise ConfigError(f"--layout dp_shard = {lay.dp_shard} is HSDP, which the {fw.name} engine does not run; "
                          "frameworks that do: " + ", ".join(n for n, f in all_frameworks().items() if f.hsdp))


def parse_layout(text: str, global_batch_seqs: int, fp32_grad_accum: bool = True, world_size: int = 0,
                 cluster: str = "", dp_given: bool = True) -> Layout:
    """`"dp=4,tp=2,pp=1,micro_batch_size=1,zero=1,recompute=none"` -> Layout (`mbs` is short for micro_batch_size);
    grad_accum_steps follows from the global batch; `fp32_grad_accum` where the text does not say (the framework's
    `default_fp32_grad_accum`). `world_size` (where given): the devices the degrees must multiply to, checked before
    the batch, whose suggestions assume the degrees; `cluster` names them in the error. `dp_given` False: the caller
    sets dp itself (`plan scaling`: the GPUs over the other degrees), so the batch is not checked against this one."""
    values: dict = {"fp32_grad_accum": fp32_grad_accum}
    seen: dict[str, str] = {}  # field -> its item: a key given twice, under its own or its short name, is refused
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise ConfigError(f"--layout {shown(text)} has an empty item; give KEY=VALUE items separated by single "
                              "commas")
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS:
            raise ConfigError(f"--layout item {shown(part)} is not KEY=VALUE with KEY one of: "
                              f"{', '.join(sorted(_KEYS))}{did_you_mean(key, _KEYS) if eq else ''}")
        key = LEGACY_NAMES.get(key, key)
        if key in seen:
            raise ConfigError(f"--layout gives {key} twice ({seen[key]} and {part}); keep one")
        seen[key] = part
        value = value.strip()
        if key == "recompute":
            if value not in RECOMPUTE:
                raise ConfigError(f"--layout recompute = {shown(value)} is not one of {list(RECOMPUTE)}")
        elif key == "schedule":
            if value not in SCHEDULES:
                raise ConfigError(f"--layout schedule = {shown(value)} is not one of {list(SCHEDULES)}")
        elif key in _ON_OFF:
            if value.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise ConfigError(f"--layout {key} = {shown(value)} must be on or off")
            value = value.lower() in ("on", "true", "1")
        else:
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"--layout {key} = {shown(value)} is not an integer") from None
            if value < (0 if key in ("zero", "dp_shard") else 1):
                raise ConfigError(f"--layout {key} = {value} must be >= {0 if key in ('zero', 'dp_shard') else 1}")
        values[key] = value
    lay = Layout(**values)
    if world_size and lay.world_size != world_size:
        raise ConfigError(f"--layout dp x tp x pp x cp = {lay.dp} x {lay.tp} x {lay.pp} x {lay.cp} = "
                          f"{lay.world_size:,} but the cluster has {world_size} GPUs{cluster}; change the degrees or "
                          "--nodes")
    raise_problem(hsdp_problem(lay))
    raise_problem(communication_problem(lay))
    if not dp_given:
        return lay
    raise_problem(batch_problem(lay, global_batch_seqs))
    return dataclasses.replace(lay, grad_accum_steps=global_batch_seqs // (lay.dp * lay.micro_batch_size))


@dataclass(frozen=True)
class Framework:
    """Implementation settings that change bytes or seconds (defaults: fp32 parameters that are the master weights,
    bf16 compute; `FIVEFOLD` below is fivefold's lean bf16 engine, `FIVEFOLD_CPU` its fp32 run on a CPU)."""

    name: str = "fivefold"
    hsdp: bool = False  # runs HSDP (ZeRO-3 sharded inside groups, replicated across them): the search tries it
    param_bytes: int = 4  # parameters as stored (4: fp32 parameters that are the master weights, as on CPU)
    grad_bytes: int = 4  # gradients as stored
    master_bytes: int = 0  # separate fp32 master copy (frameworks with bf16 parameters)
    optim_bytes: int = 8  # Adam m and v
    accum_bytes: int = 4  # the optional fp32 gradient accumulation buffer, when the layout asks for it
    # with `layout.fp32_grad_accum` the gradient buffers themselves hold `accum_bytes` per parameter (fivefold's
    # buckets and its single-device engine's fp32 gradients) instead of a separate buffer beside `grad_bytes`
    accum_in_grad_buffers: bool = False
    # bytes per parameter of whole (unsharded) gradients that a ZeRO-2/3 engine keeps between the micro-batches of
    # a gradient accumulation, reducing only after the last (FSDP2 with set_requires_gradient_sync(False) keeps them
    # in its reduce dtype: 4 under fp32 reduction); 0: reduce-scattered after every micro-batch (fivefold's ZeRO-2
    # and ZeRO-3, FSDP's default), nothing beyond the shards. One FSDP2-based framework ran out of memory this way.
    unsharded_accum_grad_bytes: int = 0
    # `layout.fp32_grad_accum` where the planner is not told (`plan --fp32-grad-accum`, `--layout`): the framework's
    # own default (fivefold's engine: on, as `fivefold train`)
    default_fp32_grad_accum: bool = False
    # the `--features` (`planner/features.py`) the framework runs, comma-separated; the planner refuses the others
    features: str = "compile,float8,async-tp"
    zero_shards_master: bool = True  # ZeRO-1 shards the master copy with the optimizer states
    autocast_weight_copies: bool = True  # bf16 weight casts saved for backward, per micro-batch in flight
    compute_dtype: str = "bf16"  # "fp32" models fivefold on CPU
    fused_loss_chunk: int = LOSS_CHUNK_TOKENS  # tokens per chunk of the fused output layer + loss; 0 = whole logits
    tp_loss_chunk: int = TP_LOSS_CHUNK_TOKENS  # the same for the vocabulary-parallel loss under tensor parallel
    logits_bytes: float = 10.0  # bytes per (token, vocabulary entry / tp) alive at the loss peak
    # the loss's bytes per (token, vocabulary entry / tp) counted at the memory peak, where they differ from
    # `logits_bytes` (which the time model also streams): 0 = logits_bytes; `tp_loss_peak_bytes` the same for the
    # vocabulary-parallel loss under tensor parallel (0 = loss_peak_bytes)
    loss_peak_bytes: float = 0.0
    tp_loss_peak_bytes: float = 0.0
    # what selective recompute keeps of a block's matmul outputs (comma-separated of q, k, v, o, gate, up, down)
    # besides the block input and the attention kernel's output and log-sum-exp: fivefold's policy keeps them all
    selective_saved_matmuls: str = "q,k,v,o,gate,up,down"
    # the same when the blocks run under torch.compile (`--features compile`); "" = selective_saved_matmuls
    compiled_selective_saved_matmuls: str = ""
    # what the step-time model charges a block's selective recompute: "attention" (its attention core's forward
    # again: the pricing the published frameworks' profiles were fitted with) or "policy" (what the policy does
    # not keep, run again: the element-wise work and its fixed costs, the matmuls not in `selective_saved_matmuls`
    # and the routed experts, plus the profile's `selective_dispatch_us`: fivefold's engine, which keeps the
    # attention kernel's output)
    selective_reruns: str = "attention"
    activation_scale: float = 1.0  # multiplies the counted saved activations (fitted for other frameworks)
    # what a block compiled by torch.compile saves for backward (`--features compile`), where the partitioner keeps
    # less than eager mode: SwiGLU's gate and up outputs and their product (silu(gate) recomputed in backward:
    # 3 tensors of the MLP width, eager 4), the routed experts' output once (eager also its weighted copy) and the
    # router logits in the compute dtype (eager: fp32). Measured on fivefold's blocks
    # (tests/test_compiled_activations.py)
    compiled_saves_less: bool = False
    tp_overlap: float = 0.0  # share of tensor-parallel communication hidden behind compute
    # gradient buckets (MiB) of an engine other than fivefold's: the memory model holds two in flight, at most the
    # rank's gradients (`memory.dp_buffer_bytes`)
    dp_bucket_mib: float = 25.0
    # the step-time model takes the gradient bucket size (`layout.dp_bucket_size`, Megatron's rule by default) and
    # the overlap of ZeRO-1/2's parameter all-gather (`layout.dp_overlap_param_gather`) and of sequence parallel's
    # backward collectives (`layout.tp_comm_overlap`) from the layout: fivefold's engine, whose switches they are
    # (the fields above describe other frameworks)
    layout_dp_options: bool = False
    fixed_overhead_gib: float = 0.0  # allocator and library workspace beyond what is counted
    usable_memory_fraction: float = 0.95  # a layout fits when its peak stays below this share of the device
    zero1_allgather_exposed: bool = True  # ZeRO-1/2 all-gather the parameters after the step, not overlapped
    residual_bytes: int = 4  # the residual stream (fivefold's lean engine keeps it bf16, 2; fp32 on CPU)
    norm_saves_normalized: bool = False  # RMSNorm also keeps its normalised input (fivefold's keeps x and 1/rms)
    sp_saves_gathered_input: bool = False  # with sp, column-parallel linears save the gathered input (else the slice)
    # with sp the column linears keep only the sequence slice and all-gather it again in backward: fivefold waits
    # for it; nanotron overlaps it with the input-gradient matmul (asynchronous communication)
    sp_regather_exposed: bool = True
    sp_norm_grad_allreduces: int = 2  # per block with sp: the two norms' weight gradients, all-reduced over tp
    fused_projections: bool = False  # q|k|v and gate|up as one linear each (fivefold runs them separately)
    # fixed-cost kernels per block forward besides its linears and attention core (norms, rope, activations,
    # adds, casts, views), and per micro-batch outside the blocks (embedding, rotary tables, final norm, loss)
    kernels_per_layer: int = 19
    kernels_per_micro_batch: int = 0
    # bytes per parameter that ZeRO-3 / FSDP gathers (0: as stored, fivefold's fp32; FSDP2 mixed precision: 2)
    gather_bytes: int = 0
    # host (CPU) time to issue one block's forward and backward per micro-batch, in µs: an eager framework's
    # Python and kernel launches. The GPU runs behind the host, so a pipeline stage takes at least its blocks
    # times this per micro-batch (0: not modelled, the GPU is never waiting for the host)
    host_us_per_layer: float = 0.0
    # what each block costs per micro-batch and tensor-parallel rank, beyond the above, when the pipeline's
    # hand-overs cross nodes (0: nothing). nanotron's hand-overs are blocking (two metadata messages, each read
    # on the host, before the data) and its async TP runs with CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue
    # for compute and every collective), so across nodes a stage's TP collectives queue behind the transfers
    cross_node_pp_us_per_layer_tp: float = 0.0
    # bytes per parameter moved after every micro-batch's backward to accumulate gradients outside autograd, under
    # `layout.fp32_grad_accum` (nanotron adds each bf16 gradient into its fp32 buffer: reads 2 + 4, writes 4)
    grad_accum_copy_bytes: float = 0.0
    # how the step-time model splits pipeline stages: "balanced" (by training FLOPs with the output layer, at
    # least one block per stage: fivefold's `layout.stage_layers` default) or "params" (nanotron's `build_model`:
    # the pipeline blocks in model order, each to the current rank, which hands over once the cumulative parameter
    # cost, a block 4 h^2 + 3 h ffn and the output layer V h, passes its share; trailing ranks may get no block,
    # and a rank left with no pipeline block at all cannot run). The memory model keeps the balanced split.
    stage_split: str = "balanced"
    # --- the compute model by kernel class (`planner/time.py`, `planner/kernels.py`) ---
    # element-wise kernel classes run as one fused kernel each (comma-separated: norm, residual, rotary, swiglu, or
    # all; torch.compile fuses all), the rest as eager PyTorch ops
    fused_elementwise: str = ""
    attention_kernel: str = "fa2"  # the row set of kernels.toml (fa2: SDPA's flash backend and flash_attn 2)
    float8_linears: bool = False  # the blocks' linears run float8 GEMMs (torchao tensorwise scaling)
    # tensor-parallel collectives micro-pipelined with the matmuls (torch's async TP, symmetric memory): only the
    # first of tp chunks is exposed
    async_tp: bool = False

    @property
    def compiled(self) -> bool:
        """Whether the blocks run under torch.compile: the `compile` feature applied (`features.with_features`)."""
        return self.fused_elementwise == "all"

    @property
    def act_bytes(self) -> int:
        return 2 if self.compute_dtype == "bf16" else 4


# fivefold's engine on an accelerator: lean mixed precision (`train.dtype` bf16, the default there; one device
# and every layout): bf16 working weights, fp32 gradients (`layout.fp32_grad_accum`, the default: the buckets hold
# fp32, accumulated and reduced in it; bf16, `grad_bytes`, with it off), an fp32 master copy stepped by AdamW with
# its moments, sharded by ZeRO-1/2 (2 + 4 + 12/N_d bytes per parameter under ZeRO-1). Under ZeRO-3 fully_shard keeps
# the fp32 shards as the master and gathers bf16 (planner/memory.py). Activations in bf16, residual stream included.
# It runs torch.compile and float8 linears (torchao, `train.float8`), not async tensor parallel (its own overlap is
# `layout.tp_comm_overlap`).
FIVEFOLD = Framework(param_bytes=2, grad_bytes=2, master_bytes=4, accum_bytes=4, autocast_weight_copies=False,
                     residual_bytes=2, gather_bytes=2, hsdp=True, accum_in_grad_buffers=True,
                     default_fp32_grad_accum=True, features="compile,float8", layout_dp_options=True,
                     compiled_saves_less=True, selective_reruns="policy")
# On CPU every operator runs eagerly on the host, so its fixed cost counts: the operators of fivefold's block
# and of its embedding + loss as the profiler counts them (tests/test_calibrate.py checks the counts). fp32
# everything: the parameters are the master weights (4 + 4 + 8 bytes per parameter; `layout.fp32_grad_accum`
# changes nothing, the gradients being fp32 already).
FIVEFOLD_CPU = dataclasses.replace(FIVEFOLD, name="fivefold-cpu", compute_dtype="fp32", param_bytes=4, grad_bytes=4,
                                   master_bytes=0, accum_bytes=4, residual_bytes=4, gather_bytes=0,
                                   logits_bytes=8.0, kernels_per_layer=42, kernels_per_micro_batch=32)
# nanotron as the playbook's benchmark ran it: bf16 parameters and gradients, fp32 master weights sharded by
# ZeRO-1, a fp32 gradient accumulation buffer, flash attention, TP always with sequence parallel and
# asynchronous TP communication, whole (vocabulary-parallel) logits. Fitted fields: see docs/planner.md.
NANOTRON = Framework(name="nanotron", param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8, accum_bytes=4,
                     autocast_weight_copies=False, fused_loss_chunk=0, logits_bytes=10.0, tp_overlap=0.5,
                     fixed_overhead_gib=1.0, residual_bytes=2, norm_saves_normalized=False,
                     sp_saves_gathered_input=False, fused_projections=True, sp_norm_grad_allreduces=0,
                     sp_regather_exposed=False, grad_accum_copy_bytes=10.0,
                     stage_split="params", fused_elementwise="norm,rotary")
# The name the lean engine had while fp32 weights under autocast were the default: the same as `fivefold` now.
FIVEFOLD_LEAN = dataclasses.replace(FIVEFOLD, name="fivefold-lean")
FRAMEWORKS = {"fivefold": FIVEFOLD, "fivefold-cpu": FIVEFOLD_CPU, "fivefold-lean": FIVEFOLD_LEAN,
              "nanotron": NANOTRON}
