"""A candidate layout (every knob of `LayoutConfig` plus the gradient accumulation that the global batch
implies) and the framework settings that turn a layout into bytes and seconds.

`Framework` holds what differs between implementations of the same techniques, so that published runs of
another framework can be modelled with its own settings: the precision of parameters and gradients, whether
autocast keeps bf16 weight copies, whether tensor parallel is overlapped, and the fixed per-device memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import ConfigError, LayoutConfig

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    mbs: int = 1
    grad_acc: int = 1
    recompute: str = "none"
    sp: bool = False
    schedule: str = "1f1b"
    vpp: int = 1
    fp32_grad_accum: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def short(self) -> str:
        s = f"dp{self.dp} tp{self.tp}{'+sp' if self.sp and self.tp > 1 else ''} pp{self.pp}"
        if self.cp > 1:
            s += f" cp{self.cp}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        s += f" z{self.zero} mbs{self.mbs} ga{self.grad_acc} rc:{self.recompute}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f" v{self.vpp}" if self.vpp > 1 else "")
        return s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_layout_config(self) -> LayoutConfig:
        return LayoutConfig(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, zero=self.zero,
                            micro_batch_size=self.mbs, recompute=self.recompute, sp=self.sp,  # type: ignore[arg-type]
                            schedule=self.schedule, vpp=self.vpp, fp32_grad_accum=self.fp32_grad_accum)  # type: ignore[arg-type]


_KEYS = {"dp", "tp", "pp", "cp", "ep", "zero", "mbs", "recompute", "sp", "schedule", "vpp", "fp32_grad_accum"}


def parse_layout(text: str, global_batch_seqs: int) -> Layout:
    """`"dp=4,tp=2,pp=1,mbs=1,zero=1,recompute=none"` -> Layout; grad_acc follows from the global batch."""
    values: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS:
            raise ConfigError(f"--layout item {part!r} is not KEY=VALUE with KEY one of: {', '.join(sorted(_KEYS))}")
        value = value.strip()
        if key == "recompute":
            if value not in RECOMPUTE:
                raise ConfigError(f"--layout recompute = {value!r} is not one of {list(RECOMPUTE)}")
        elif key == "schedule":
            from fivefold.parallel.schedules import SCHEDULES

            if value not in SCHEDULES:
                raise ConfigError(f"--layout schedule = {value!r} is not one of {list(SCHEDULES)}")
        elif key in ("sp", "fp32_grad_accum"):
            if value.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise ConfigError(f"--layout {key} = {value!r} must be on or off")
            value = value.lower() in ("on", "true", "1")
        else:
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"--layout {key} = {value!r} is not an integer") from None
            if value < (0 if key == "zero" else 1):
                raise ConfigError(f"--layout {key} = {value} must be >= {0 if key == 'zero' else 1}")
        values[key] = value
    lay = Layout(**values)
    per_step = lay.dp * lay.mbs
    if global_batch_seqs % per_step:
        raise ConfigError(
            f"--layout dp x mbs = {lay.dp} x {lay.mbs} = {per_step} does not divide the global batch of "
            f"{global_batch_seqs} sequences; use a dp x mbs that divides it (e.g. mbs in "
            f"{[d for d in range(1, 17) if global_batch_seqs % (lay.dp * d) == 0][:5]})"
        )
    return dataclasses.replace(lay, grad_acc=global_batch_seqs // per_step)


@dataclass(frozen=True)
class Framework:
    """Implementation settings that change bytes or seconds (defaults: fivefold's engine on an accelerator)."""

    name: str = "fivefold"
    param_bytes: int = 4  # parameters as stored (fivefold keeps fp32 parameters, which are the master weights)
    grad_bytes: int = 4  # gradients as stored
    master_bytes: int = 0  # separate fp32 master copy (frameworks with bf16 parameters)
    optim_bytes: int = 8  # Adam m and v
    accum_bytes: int = 4  # the optional fp32 gradient accumulation buffer, when the layout asks for it
    zero_shards_master: bool = True  # ZeRO-1 shards the master copy with the optimizer states
    autocast_weight_copies: bool = True  # bf16 weight casts saved for backward, per micro-batch in flight
    compute_dtype: str = "bf16"  # "fp32" models fivefold on CPU
    fused_loss_chunk: int = 8192  # tokens per chunk of the fused output layer + cross-entropy; 0 = whole logits
    tp_loss_chunk: int = 4096  # the same for the vocabulary-parallel loss under tensor parallel
    logits_bytes: float = 10.0  # bytes per (token, vocabulary entry / tp) alive at the loss peak
    activation_scale: float = 1.0  # multiplies the counted saved activations (fitted for other frameworks)
    tp_overlap: float = 0.0  # share of tensor-parallel communication hidden behind compute
    dp_bucket_mib: float = 25.0  # gradient buckets (MiB)
    fixed_overhead_gib: float = 0.0  # allocator and library workspace beyond what is counted
    usable_memory_fraction: float = 0.95  # a layout fits when its peak stays below this share of the device
    zero1_allgather_exposed: bool = True  # ZeRO-1/2 all-gather the parameters after the step, not overlapped
    residual_bytes: int = 4  # the residual stream (fivefold keeps it fp32 under autocast)
    norm_saves_normalized: bool = True  # RMSNorm saves its normalised input too (an unfused norm)
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

    @property
    def act_bytes(self) -> int:
        return 2 if self.compute_dtype == "bf16" else 4


FIVEFOLD = Framework()
# On CPU every operator runs eagerly on the host, so its fixed cost counts: the operators of fivefold's block
# and of its embedding + loss as the profiler counts them (tests/test_calibrate.py checks the counts).
FIVEFOLD_CPU = dataclasses.replace(FIVEFOLD, name="fivefold-cpu", compute_dtype="fp32", autocast_weight_copies=False,
                                   logits_bytes=8.0, kernels_per_layer=42, kernels_per_micro_batch=33)
# nanotron as the playbook's benchmark ran it: bf16 parameters and gradients, fp32 master weights sharded by
# ZeRO-1, a fp32 gradient accumulation buffer, flash attention, TP always with sequence parallel and
# asynchronous TP communication, whole (vocabulary-parallel) logits. Fitted fields: see docs/planner.md.
NANOTRON = Framework(name="nanotron", param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8, accum_bytes=4,
                     autocast_weight_copies=False, fused_loss_chunk=0, logits_bytes=10.0, tp_overlap=0.5,
                     fixed_overhead_gib=1.0, residual_bytes=2, norm_saves_normalized=False,
                     sp_saves_gathered_input=False, fused_projections=True, sp_norm_grad_allreduces=0,
                     sp_regather_exposed=False)
FRAMEWORKS = {"fivefold": FIVEFOLD, "fivefold-cpu": FIVEFOLD_CPU, "nanotron": NANOTRON}
