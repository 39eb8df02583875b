"""One typed, validated config: model, layout, training, data, logging.

A config comes from defaults, then a TOML or YAML file, then command-line overrides
(`--section.field value`). `validate()` checks every field before any expensive work starts and
raises `ConfigError` naming the field, the value, the rule and what would be valid.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import reprlib
import tomllib
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field, the value and the rule."""


MAX_MODULES = 1 << 16  # layers or experts of a model
MAX_DIM = 2**31 - 1  # one dim of a weight or a sequence
MAX_INT = 2**53  # any integer field: beyond it a count is not exact as a float, which the planner's arithmetic uses
MAX_THREADS = 1024  # CPU threads of one process: thousands crash the OpenMP runtime; `check_start` also says cores
MAX_TIMED_STEPS = 100_000  # steps of a benchmark or a sweep's run: a few are timed; 10^5 is hours at any size
SHOWN_CHARS = 200  # the most characters of a value that an error message prints
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, SHOWN_CHARS, SHOWN_CHARS
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8


def finite_float(text: str) -> float:
    """The argparse type of every float flag of every verb: a finite number (nan and inf pass every comparison and
    would, e.g., turn a timeout off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{shown(text)} must be a finite number (nan and inf are refused)")
    return value


def int_in(low: int, high: int, why: str) -> typing.Callable[[str], int]:
    """The argparse type of an integer flag that multiplies work: `low` <= value <= `high`, `why` the rule's reason
    (said in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value:,} is not between {low:,} and {high:,} ({why})")
        return value

    parse.__name__ = "integer"
    return parse


def shown(value: Any) -> str:
    """The repr of `value` for an error message, at most SHOWN_CHARS characters: a value from a file or a flag may
    be huge (a string of megabytes, a YAML alias tree that expands to gigabytes), and no message should be. Nested
    containers are cut after a few items and levels without expanding the rest."""
    if isinstance(value, BaseException):
        text = str(value)
    else:
        text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 5] + "[...]"


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """' (did you mean 'X'?)' naming the one of `choices` closest to `word` (a misspelling, another case), for the
    refusal of an unknown name; '' when none is close."""
    if not isinstance(word, str) or not word:
        return ""
    lowered = {c.lower(): c for c in choices if isinstance(c, str)}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.7)
    return f" (did you mean {shown(lowered[close[0]])}?)" if close else ""


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a carriage return or line feed in a path from a flag,
    any other control or line-separator character) written as its escape, so that a refusal stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def divisors(n: int) -> list[int]:
    """The divisors of `n` >= 1, in increasing order, in O(sqrt n) (a batch of 2^30 sequences stays instant)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def nearest_divisors(n: int, value: int, k: int = 3) -> list[int]:
    """The `k` divisors of `n` closest to `value`, for error messages."""
    return sorted(sorted(divisors(n), key=lambda d: (abs(d - value), d))[:k])


MLP_KINDS = ("swiglu", "gelu")
ATTN_MASKS = ("causal", "document")  # model.attn_mask (fivefold.models.masking)
MOE_IMPLS = ("grouped", "padded")  # model.moe_impl (fivefold.models.llama.MoE)
ROUTER_SCORES = ("softmax", "sigmoid")  # model.router_scores
AUX_LOSSES = ("switch", "sequence")  # model.aux_loss
QK_NORMS = ("none", "head", "full")  # model.qk_norm


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (dense, or mixture-of-experts when `n_experts > 0`)."""

    name: str = "tiny"
    n_layers: int = 4
    hidden: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 384
    vocab_size: int = 2048
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    # Llama-3 frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; empty means none.
    rope_scaling: dict[str, float] = field(default_factory=dict)
    norm_eps: float = 1e-5
    tied_embeddings: bool = True
    init_std: float = 0.02
    # Keep the residual stream (the embedding output and the sum of the blocks' outputs) in fp32 when the weights
    # are bf16 (lean mixed precision); the blocks still compute in bf16. Costs 2 bytes per element of the stream.
    fp32_residual: bool = False
    # Mixture of experts (every block's MLP becomes an MoE layer when n_experts > 0).
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    moe_ffn: int = 0  # hidden size of one expert; 0 means `ffn`
    aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0  # 0 = dropless; > 0 = capacity-based routing that drops overflow
    # how the routed experts run: "grouped" (tokens sorted by expert on the device, one grouped matmul, no padding,
    # no host read of the counts without expert parallel) or "padded" (one batched matmul over [experts, busiest
    # expert's tokens, hidden], sized by a host read; kept for side-by-side comparison)
    moe_impl: str = "grouped"
    # the router's scores: "softmax" over the experts (Mixtral, Qwen, OLMoE) or an independent "sigmoid" per expert
    # (DeepSeek-V3); norm_topk divides a token's top-k scores by their sum (its routing weights then add up to 1)
    router_scores: str = "softmax"
    norm_topk: bool = True
    # the load-balancing loss weighted by aux_loss_coef: "switch" (Switch Transformer, over the micro-batch's tokens)
    # or "sequence" (DeepSeek-V3's sequence-wise loss: the same product within each sequence, averaged over them)
    aux_loss: str = "switch"
    router_z_loss_coef: float = 0.0  # ST-MoE's router z-loss: mean over tokens of logsumexp(router logits)^2
    # auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores to choose the top-k (not to
    # weigh them), moved by this rate after each optimizer step towards the mean load (b_e += rate * sign(mean load -
    # load_e), the loads of the whole global batch); 0 = off
    bias_update_rate: float = 0.0
    # the MLP: "swiglu" (gate, up, down; Llama, what the engine builds) or "gelu" (up, GELU, down; GPT-2/NeoX,
    # modelled by the planner only)
    mlp: str = "swiglu"
    # "causal": every token attends to the earlier tokens of its sequence; "document": only to those of its own
    # document, with rotary positions restarting at each document (fivefold.models.masking)
    attn_mask: str = "causal"
    # each token attends to itself and the sliding_window - 1 tokens before it (Mistral's convention); None
    # (null, or left out) for no window
    sliding_window: int | None = None
    # RMSNorm of the queries and keys before the rotary embedding: "head" normalises each head (Qwen3, one weight of
    # head_dim shared by the heads), "full" the whole projection (OLMoE, weights of heads x head_dim); "none": Llama
    qk_norm: str = "none"
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    # the shared experts' output scaled by sigmoid(a learned linear function of the token) (Qwen2-MoE)
    shared_expert_gate: bool = False
    # the width of one attention head when it is not hidden / n_heads (Qwen3-MoE, Gemma: n_heads x head_size query
    # and output projections); None (null, or left out): hidden / n_heads
    head_size: int | None = None

    @property
    def head_dim(self) -> int:
        """The width of one attention head: `head_size`, or hidden / n_heads."""
        return self.hidden // self.n_heads if self.head_size is None else self.head_size

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def masks_attention(self) -> bool:
        """Whether attention executes fewer pairs than plain causal attention (a document mask, a sliding window):
        it then runs one kernel call per document or window tile (`models.masking`)."""
        return self.attn_mask == "document" or self.sliding_window is not None

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (or expert): gate, up, down for SwiGLU; up, down for GELU."""
        return 3 if self.mlp == "swiglu" else 2

    def validate(self, prefix: str = "model") -> None:
        for f in dataclasses.fields(self):  # inf and nan pass every comparison below
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{prefix}.{f.name} = {shown(value)} must be a finite number")
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab_size", "max_seq_len"):
            _require(getattr(self, name) >= 1, f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        for name in ("n_layers", "n_experts"):  # one module (and one planner row) each
            _require(getattr(self, name) <= MAX_MODULES, f"{prefix}.{name}", getattr(self, name),
                     f"must be at most {MAX_MODULES:,} (each is a module of its own; the largest models have ~100)")
        for name in ("hidden", "n_heads", "n_kv_heads", "ffn", "vocab_size", "max_seq_len", "moe_ffn"):
            _require(getattr(self, name) <= MAX_DIM, f"{prefix}.{name}", getattr(self, name),
                     f"must be at most {MAX_DIM:,} (2^31 - 1: a tensor dim that kernels index with 32-bit integers)")
        if self.head_size is not None:
            _require(1 <= self.head_size <= MAX_DIM, f"{prefix}.head_size", self.head_size,
                     f"must be between 1 and {MAX_DIM:,}, or null (left out) for hidden / n_heads")
        elif self.hidden % self.n_heads:
            raise ConfigError(
                f"{prefix}.n_heads = {self.n_heads} does not divide {prefix}.hidden = {self.hidden}; "
                f"valid n_heads for this hidden size: {nearest_divisors(self.hidden, self.n_heads, 5)} (or give "
                f"{prefix}.head_size)"
            )
        if self.head_dim % 2:
            what = f"{prefix}.head_size" if self.head_size is not None else f"{prefix}.hidden / {prefix}.n_heads"
            raise ConfigError(f"{what} = {self.head_dim} is odd; rotary embeddings need an even head dimension")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"{prefix}.n_kv_heads = {self.n_kv_heads} does not divide {prefix}.n_heads = {self.n_heads}; "
                f"valid n_kv_heads: {divisors(self.n_heads)}"
            )
        _require(self.mlp in MLP_KINDS, f"{prefix}.mlp", self.mlp, f"must be one of {', '.join(MLP_KINDS)}")
        _require(self.attn_mask in ATTN_MASKS, f"{prefix}.attn_mask", self.attn_mask,
                 f"must be one of {', '.join(ATTN_MASKS)}")
        _require(self.qk_norm in QK_NORMS, f"{prefix}.qk_norm", self.qk_norm, f"must be one of {', '.join(QK_NORMS)}")
        _require(self.sliding_window is None or self.sliding_window >= 1, f"{prefix}.sliding_window",
                 self.sliding_window, "must be >= 1 (tokens each query sees, itself included), or null (left out) "
                 "for no window")
        _require(self.rope_theta > 0, f"{prefix}.rope_theta", self.rope_theta, "must be > 0")
        _require(self.norm_eps > 0, f"{prefix}.norm_eps", self.norm_eps, "must be > 0")
        _require(self.init_std > 0, f"{prefix}.init_std", self.init_std, "must be > 0")
        if self.rope_scaling:
            need = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            missing = need - set(self.rope_scaling)
            if missing:
                raise ConfigError(f"{prefix}.rope_scaling lacks keys {sorted(missing)}; it needs {sorted(need)}")
            extra = set(self.rope_scaling) - need
            if extra:
                raise ConfigError(f"{prefix}.rope_scaling has unknown keys {sorted(extra)}; it takes {sorted(need)}")
            for key in sorted(need):  # Llama 3's frequency scaling divides by each of them
                value = self.rope_scaling[key]
                _require(isinstance(value, int | float) and not isinstance(value, bool) and value > 0,
                         f"{prefix}.rope_scaling.{key}", value, "must be a number > 0")
            _require(self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"],
                     f"{prefix}.rope_scaling.high_freq_factor", self.rope_scaling["high_freq_factor"],
                     f"must be above low_freq_factor = {self.rope_scaling['low_freq_factor']}")
        _require(self.n_experts >= 0, f"{prefix}.n_experts", self.n_experts, "must be >= 0")
        if self.n_experts:
            _require(
                1 <= self.top_k <= self.n_experts, f"{prefix}.top_k", self.top_k,
                f"must be between 1 and n_experts = {self.n_experts}",
            )
            _require(self.n_shared_experts >= 0, f"{prefix}.n_shared_experts", self.n_shared_experts, "must be >= 0")
            _require(self.moe_ffn >= 0, f"{prefix}.moe_ffn", self.moe_ffn, "must be >= 0 (0 means ffn)")
            _require(self.aux_loss_coef >= 0, f"{prefix}.aux_loss_coef", self.aux_loss_coef, "must be >= 0")
            _require(not self.shared_expert_gate or self.n_shared_experts > 0, f"{prefix}.shared_expert_gate",
                     self.shared_expert_gate, "needs shared experts (n_shared_experts >= 1)")
            _require(self.moe_impl in MOE_IMPLS, f"{prefix}.moe_impl", self.moe_impl,
                     f"must be one of {', '.join(MOE_IMPLS)}")
            _require(self.router_scores in ROUTER_SCORES, f"{prefix}.router_scores", self.router_scores,
                     f"must be one of {', '.join(ROUTER_SCORES)}")
            _require(self.aux_loss in AUX_LOSSES, f"{prefix}.aux_loss", self.aux_loss,
                     f"must be one of {', '.join(AUX_LOSSES)}")
            _require(self.router_z_loss_coef >= 0, f"{prefix}.router_z_loss_coef", self.router_z_loss_coef,
                     "must be >= 0 (0 = off; ST-MoE used 0.001)")
            _require(self.bias_update_rate >= 0, f"{prefix}.bias_update_rate", self.bias_update_rate,
                     "must be >= 0 (0 = off; DeepSeek-V3 used 0.001)")
            _require(
                self.capacity_factor == 0 or self.capacity_factor >= 1.0, f"{prefix}.capacity_factor",
                self.capacity_factor, "must be 0 (dropless) or >= 1.0",
            )


@dataclass
class LayoutConfig:
    """How the model is spread over devices (see docs/parallelism.md); checked as a whole by
    `fivefold.layout.check_layout`."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # expert tensor parallel: the tp ranks each routed expert's ffn dim is split over, 1 or layout.tp. 1 (the
    # default): experts stay whole and each tp rank routes and dispatches its own 1/tp of the tokens, so tokens
    # travel once per tp group and the tp ranks hold the same experts (their gradients reduced with the edp
    # ranks'); layout.tp: every expert split like a dense MLP, each tp rank routing all the tokens
    etp: int = 1
    zero: int = 0
    micro_batch_size: int = 0  # sequences per micro-batch per rank; 0 = the whole per-rank batch at once
    recompute: Literal["none", "selective", "full"] = "none"
    sp: bool = False
    schedule: Literal["afab", "1f1b", "interleaved", "zero-bubble", "dualpipev"] = "1f1b"
    vpp: int = 1
    # blocks per pipeline stage in model order (pp x vpp stages, 2 pp for dualpipev); empty = balanced by compute
    stage_layers: list[int] = field(default_factory=list)
    # gradients accumulated over the micro-batches and reduced in fp32 whatever the working weights' dtype; false keeps
    # them in bf16 under bf16 working weights (1e-2 relative lost over 64 micro-batches, tests/test_lean_single.py);
    # no effect where the weights are fp32 (the CPU default)
    fp32_grad_accum: bool = True
    # HSDP: ZeRO-3 shards over groups of dp_shard x cp ranks and replicates over the dp / dp_shard groups (each
    # shard's gradient all-reduced across them); 0 = over all of dp x cp (FSDP)
    dp_shard: int = 0
    # elements per gradient bucket of ZeRO-0/1/2 (each bucket reduced as soon as backward has filled it); null (left
    # out) = Megatron's rule, max(40,000,000, 1,000,000 x dp x cp) (`dp_bucket_elements`); ZeRO-3 shards by block
    dp_bucket_size: int | None = None
    # ZeRO-1/2: the updated parameters' all-gather after the optimizer step runs under the next forward, bucket by
    # bucket (each block waits for its own buckets first); null = on wherever it applies, false = the step waits
    dp_overlap_param_gather: bool | None = None
    # pipeline (afab, 1f1b, interleaved under ZeRO-0/1/2): a whole backward sends its input gradient before it
    # computes its stage's first block's weight gradients (deferred as the zero-bubble schedules' W passes); null =
    # on wherever pp > 1, false = the strict order (to debug, or to measure the overlap). No effect under ZeRO-3,
    # whose stages defer no weight gradient (fully_shard's hooks collect them within the backward), so the send
    # leaves after the whole backward on or off, nor under zero-bubble and dualpipev, whose schedules split every
    # backward themselves. Either way every run posts its receives ahead, each waited for alone
    # (`pipeline_comm.PointToPoint`): under ZeRO-3 that posting is all the overlap there is
    pp_comm_overlap: bool | None = None
    # DualPipeV: the forward of one chunk and the backward of the other (the F0B1 / F1B0 pairs) run as two lanes,
    # one micro-batch's tp, cp or ep collectives under the other's compute (`parallel.lanes`); null = on wherever
    # it applies (`overlaps_fb`), false = one after the other
    pp_fb_overlap: bool | None = None
    # tensor parallel with sp: the backward of the column linears (q/k/v, gate/up) all-gathers their input for the
    # weight gradients while it computes the input gradient, and reduce-scatters the input gradient while it computes
    # the weight gradients (asynchronous collectives); null = on wherever tp > 1 with sp, false = one after the other
    tp_comm_overlap: bool | None = None

    @property
    def dp_bucket_elements(self) -> int:
        """Elements per gradient bucket: `dp_bucket_size`, or Megatron's rule max(40 M, 1 M x the ranks reducing)."""
        return self.dp_bucket_size or max(40_000_000, 1_000_000 * self.dp * self.cp)

    @property
    def gathers_params_after_step(self) -> bool:
        """Whether the parameters are all-gathered after the optimizer step: ZeRO-1/2 over dp x cp >= 2."""
        return 1 <= self.zero <= 2 and self.dp * self.cp > 1

    @property
    def overlaps_param_gather(self) -> bool:
        """Whether ZeRO-1/2's parameter all-gather runs under the next forward (`dp_overlap_param_gather`)."""
        return self.dp_overlap_param_gather is not False and self.gathers_params_after_step

    @property
    def overlaps_pp_comm(self) -> bool:
        """Whether the pipeline's point-to-point overlaps compute (`pp_comm_overlap`)."""
        return self.pp_comm_overlap is not False and self.pp > 1

    @property
    def overlaps_fb(self) -> bool:
        """Whether DualPipeV runs the forward and the backward of two micro-batches as two lanes, one's collectives
        under the other's compute (`pp_fb_overlap`)."""
        return self.pp_fb_overlap is not False and self.fb_overlap_applies

    @property
    def fb_pairs_run_w(self) -> bool:
        """Whether a DualPipeV pair's backward lane also runs its W pass (`Schedule.unit`): where W communicates (tp
        with sp: the column linears gather their input again for their weight gradients), so that those gathers run
        under the forward's compute, as DualPipe overlaps a forward with a whole backward; elsewhere W has nothing
        to hide and runs after the pair, whose outputs then leave sooner."""
        return self.overlaps_fb and self.tp > 1 and self.sp

    @property
    def fb_overlap_applies(self) -> bool:
        """DualPipeV over pp >= 2 whose stages have collectives of their own (tp, cp or ep > 1), not under ZeRO-3
        (whose fully_shard hooks gather and reduce-scatter outside the lanes)."""
        return self.schedule == "dualpipev" and self.pp > 1 and self.tp * self.cp * self.ep > 1 and self.zero < 3

    @property
    def overlaps_tp_comm(self) -> bool:
        """Whether sequence parallel's backward overlaps its collectives with the matmuls (`tp_comm_overlap`)."""
        return self.tp_comm_overlap is not False and self.tp > 1 and self.sp

    @property
    def world_size(self) -> int:
        # ep folds over dp x cp, so it does not multiply the world size
        return self.dp * self.tp * self.pp * self.cp

    @property
    def zero_group(self) -> int:
        """The ranks one ZeRO shard set spans: dp_shard x cp under HSDP, else dp x cp."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def splits_experts_over_tp(self) -> bool:
        """Whether every routed expert's ffn dim is split over the tp ranks (etp = tp > 1)."""
        return self.etp > 1

    @property
    def splits_tokens_over_tp(self) -> bool:
        """Whether each tp rank routes its own 1/tp of an MoE layer's tokens (tp > 1 with whole experts, etp = 1)."""
        return self.tp > 1 and self.etp == 1

    @property
    def experts_apart(self) -> bool:
        """Whether an MoE model's routed experts reduce (and shard) over groups of their own, the ranks that hold the
        same experts (edp), rather than with the dense weights: under ep, and with whole experts on tp ranks that
        route different tokens (etp = 1)."""
        return self.ep > 1 or self.splits_tokens_over_tp

    @property
    def expert_zero_group(self) -> int:
        """The ranks one ZeRO shard set of an ep rank's routed experts spans: those of the zero group that hold
        the same experts (zero_group / ep; dp x cp / ep without HSDP), times tp when the experts are whole on every
        tp rank (etp = 1)."""
        return max(self.zero_group // self.ep, 1) * (self.tp if self.splits_tokens_over_tp else 1)

    @property
    def zero_replicas(self) -> int:
        """HSDP's replicas of each shard set (1 without HSDP)."""
        return self.dp // self.dp_shard if self.dp_shard else 1


@dataclass
class TrainConfig:
    seq_len: int = 128
    global_batch_size: int = 32  # sequences per optimizer step, whatever the layout
    max_steps: int = 450
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    wsd_decay_fraction: float = 0.2
    # a resume with more train.max_steps than the run's schedule had: hold its final rate, decay from it over the new
    # steps, or plan train.lr_schedule again over the new total (the rate rises); see docs/training.md
    lr_on_extension: Literal["hold", "decay", "stretch"] = "hold"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda | xpu | ...
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 (lean mixed precision) on accelerators, fp32 on CPU
    compile: bool = False
    # the blocks' linears as float8 GEMMs through torchao (pip install 'fivefold[float8]'): 'rowwise' or 'tensorwise'
    # scales, 'off' keeps them in the working dtype; see fivefold.parallel.float8
    float8: Literal["off", "rowwise", "tensorwise"] = "off"
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 2
    # the checkpoints of checkpoint_every written by a background thread from a host copy of the state (pinned on
    # accelerators) while training goes on, at most one in flight; false: the step waits for the write
    async_checkpoint: bool = True
    max_bad_steps: int = 5  # stop after this many steps in a row with a non-finite loss or gradient norm (skipped)
    threads: int = 0  # CPU intra-op threads per process; 0 = the cores divided by the local processes
    # longest wait of a collective (and of the watchdog for a stalled rank) before the job ends; see
    # docs/operations.md
    collective_timeout_s: float = 600.0


@dataclass
class DataConfig:
    path: str = ""  # a directory written by `fivefold data prepare`; empty = the built-in corpus
    val_fraction: float = 0.05  # used when the built-in corpus is prepared


@dataclass
class LogConfig:
    log_every: int = 10
    progress: Literal["auto", "bar", "plain", "none"] = "auto"
    tensorboard: bool = False  # scalars to RUN_DIR/tensorboard (pip install 'fivefold[tensorboard]')
    wandb: bool = False  # Weights & Biases run in RUN_DIR/wandb (pip install 'fivefold[wandb]')
    wandb_project: str = "fivefold"
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: files only, `wandb sync` uploads them later
    peak_tflops: float = 0.0  # dense bf16 peak per device for MFU; 0 = look the device up
    profile: bool = False
    profile_steps: int = 3


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run_dir: str = "runs/default"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _check_float8(self) -> None:
        """Every dim of a float8 linear (after the tp split) a multiple of 16, as float8 GEMMs need; no tp overlap
        asked for, which float8 linears do not run."""
        m, tp = self.model, self.layout.tp
        if self.layout.tp_comm_overlap:
            raise ConfigError(f"layout.tp_comm_overlap = true with train.float8 = {shown(self.train.float8)}: the "
                              "float8 linears take sequence parallel's gathered input through their modules, so no "
                              "collective runs under their matmuls; leave it out, or use train.float8 = 'off'")
        dims = {"model.hidden": m.hidden, "model.n_heads x model.head_dim / layout.tp": m.n_heads * m.head_dim // tp,
                "model.n_kv_heads x model.head_dim / layout.tp": m.n_kv_heads * m.head_dim // tp}
        if m.n_experts == 0:
            dims["model.ffn / layout.tp"] = m.ffn // tp
        elif m.n_shared_experts:
            dims["model.n_shared_experts x model.moe_ffn / layout.tp"] = m.n_shared_experts * m.expert_ffn // tp
        for name, value in dims.items():
            if value % 16:
                raise ConfigError(f"train.float8 = {shown(self.train.float8)} runs the blocks' linears as float8 "
                                  f"GEMMs, whose dims must be multiples of 16: {name} = {value} is not; use a "
                                  "shape whose dims are, or train.float8 = 'off'")

    def validate(self) -> None:
        self.model.validate()
        if self.model.mlp != "swiglu":
            raise ConfigError(f"model.mlp = {shown(self.model.mlp)}: the engine builds Llama-style blocks, "
                              f"whose MLP is "
                              "SwiGLU ('swiglu'); other MLPs are for `fivefold plan` (e.g. --model ...,mlp=gelu)")
        _require_finite(self)
        t, la = self.train, self.layout
        for name in ("seq_len", "global_batch_size", "max_steps", "eval_batches", "keep_checkpoints",
                     "max_bad_steps"):
            _require(getattr(t, name) >= 1, f"train.{name}", getattr(t, name), "must be >= 1")
        _require(0 <= t.seed < 2**63, "train.seed", t.seed, "must be a non-negative integer below 2**63")
        _require(t.lr > 0, "train.lr", t.lr, "must be > 0")
        _require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
        _require(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0")
        _require(0 < t.wsd_decay_fraction <= 1, "train.wsd_decay_fraction", t.wsd_decay_fraction, "must be in (0, 1]")
        _require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
        _require(0 <= t.beta1 < 1, "train.beta1", t.beta1, "must be in [0, 1)")
        _require(0 <= t.beta2 < 1, "train.beta2", t.beta2, "must be in [0, 1)")
        _require(t.eps > 0, "train.eps", t.eps, "must be > 0")
        _require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")
        _require(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0 (0 = only at the end)")
        _require(t.checkpoint_every >= 0, "train.checkpoint_every", t.checkpoint_every,
                 "must be >= 0 (0 = only at the end)")
        _require(0 <= t.threads <= MAX_THREADS, "train.threads", t.threads,
                 f"must be between 0 (the default share of the cores) and {MAX_THREADS} (threads of one process)")
        _require(t.collective_timeout_s >= 1, "train.collective_timeout_s", t.collective_timeout_s,
                 "must be >= 1 second (default 600)")
        if t.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {self.model.max_seq_len}; "
                f"use train.seq_len <= {self.model.max_seq_len} or raise model.max_seq_len"
            )
        if self.model.sliding_window is not None and self.model.sliding_window > t.seq_len:
            raise ConfigError(
                f"model.sliding_window = {self.model.sliding_window} exceeds train.seq_len = {t.seq_len}: a window "
                f"longer than the sequence masks nothing; use 1 to {t.seq_len}, or leave it out (null) for no window"
            )
        if self.model.masks_attention and t.compile:
            raise ConfigError(f"model.attn_mask = {self.model.attn_mask!r} with model.sliding_window = "
                              f"{self.model.sliding_window} cannot run under train.compile = true (its attention "
                              "runs one kernel per document); use train.compile = false")
        if t.float8 != "off":
            self._check_float8()
        if self.model.sliding_window is not None and la.cp > 1:
            raise ConfigError(f"model.sliding_window = {self.model.sliding_window} does not run under layout.cp = "
                              f"{la.cp} (ring attention masks documents, not windows); use layout.cp = 1")
        _require(0 < self.data.val_fraction <= 0.5, "data.val_fraction", self.data.val_fraction,
                 "must be in (0, 0.5]")
        _require(self.log.log_every >= 1, "log.log_every", self.log.log_every, "must be >= 1")
        _require(self.log.peak_tflops >= 0, "log.peak_tflops", self.log.peak_tflops, "must be >= 0 (0 = look up)")
        _require(self.log.profile_steps >= 1, "log.profile_steps", self.log.profile_steps, "must be >= 1")
        for name in ("dp", "tp", "pp", "cp", "ep", "etp", "vpp"):
            _require(getattr(la, name) >= 1, f"layout.{name}", getattr(la, name), "must be >= 1")
        _require(la.zero in (0, 1, 2, 3), "layout.zero", la.zero, "must be 0, 1, 2 or 3")
        _require(la.micro_batch_size >= 0, "layout.micro_batch_size", la.micro_batch_size,
                 "must be >= 1, or 0 for the whole per-rank batch")
        from fivefold.layout import batch_problem, raise_problem  # the rule book imports this module

        raise_problem(batch_problem(la, t.global_batch_size))

    @property
    def micro_batch_size(self) -> int:
        return self.layout.micro_batch_size or self.train.global_batch_size // self.layout.dp

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.layout.dp * self.micro_batch_size)


def _require_finite(cfg: Config) -> None:
    """Every float field a finite number: inf and nan pass the comparisons of `validate` and train to NaN."""
    for section in ("model", "layout", "train", "data", "log"):
        part = getattr(cfg, section)
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{f.name} = {shown(value)} must be a finite number")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
                raise ConfigError(f"{section}.{f.name} = {shown(value)} is beyond 2^53 = {MAX_INT:,}, the largest "
                                  "integer a config holds exactly")
        for key, value in (part.rope_scaling.items() if section == "model" else ()):
            if not math.isfinite(value):
                raise ConfigError(f"model.rope_scaling.{key} = {shown(value)} must be a finite number")


def check_device_name(name: str, field: str = "train.device") -> None:
    """`field` (`train.device`, or a flag that names a device) names a device PyTorch knows (checked, with whether
    this machine has it, when a run starts on it: a config may name a device of another machine, e.g. a sweep's
    SLURM jobs)."""
    import torch

    if name == "auto":
        return
    try:
        torch.device(name)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"{field} = {shown(name)} is not a device PyTorch knows ({type(e).__name__}: "
                          f"{shown(str(e))}); use auto, cpu, or an accelerator type such as cuda, cuda:1 or "
                          "xpu") from None


def _require(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {shown(value)} {rule}")


# ---------------------------------------------------------------------------------------------
# Loading, overrides and serialisation


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_TYPE_WORDS = {bool: "boolean", int: "number", float: "number", list: "list", tuple: "list", dict: "table"}


def _coerce(value: Any, typ: Any, name: str, typed: bool = False) -> Any:
    """Convert `value` (from a file or the command line) to the annotated type of field `name`. `typed`: the value
    comes from a file, whose format writes integers and booleans unquoted, so a quoted "2" or "yes" there is refused
    rather than read as the command line's strings are (floats stay lenient: PyYAML reads 3e-4 as a string). From
    anywhere, a boolean is not a number and only text is a string (a number, list or table given for a name, a path
    or a device is refused rather than turned into its text)."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{name} = {shown(value)} is not one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(kinds) < len(typing.get_args(typ)) and (
                value is None or isinstance(value, str) and value.strip().lower() in ("null", "none")):
            return None
        return _coerce(value, kinds[0], name, typed) if len(kinds) == 1 else value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if typed and isinstance(value, str):
            raise ConfigError(f"{name} = {shown(value)} is a quoted string, not a boolean; write true or false "
                              "without quotes")
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name} = {shown(value)} is not a boolean (true/false)")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} = {shown(value)} is not an integer")
        if typed and isinstance(value, str):
            raise ConfigError(f"{name} = {shown(value)} is a quoted string, not an integer; write the number without "
                              "quotes")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} = {shown(value)} is not an integer") from None
    if typ is float:
        if isinstance(value, bool):  # float(True) is 1.0: `lr = true` would train at a rate of 1
            raise ConfigError(f"{name} = {shown(value)} is a boolean, not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} = {shown(value)} is not a number") from None
    if typ is str:
        if isinstance(value, bool | int | float | list | tuple | dict):  # str() would make "[1, 2]" a name or path
            raise ConfigError(f"{name} = {shown(value)} is a {_TYPE_WORDS.get(type(value), type(value).__name__)}, not "
                              "a string; write the text in quotes")
        return str(value)
    if origin is list:
        if isinstance(value, str):  # from the command line: "3,3,2"
            value = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
            if any(" " in v for v in value):  # "3 1" would read as 31
                raise ConfigError(f"{name} = {shown(value)}: separate the items with commas (3,1 or [3, 1])")
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name} = {shown(value)} is not a list (write it as 3,3,2 or [3, 3, 2])")
        item = typing.get_args(typ)[0]
        return [_coerce(v, item, f"{name}[{i}]", typed) for i, v in enumerate(value)]
    if origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError:
                raise ConfigError(f"{name} = {shown(value)} is not a JSON object") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name} = {shown(value)} is not a table/mapping")
        return {str(k): _coerce(v, float, f"{name}.{k}") for k, v in value.items()}
    return value


def _apply(obj: Any, values: dict[str, Any], prefix: str, typed: bool = False) -> None:
    """Set the fields of `obj` named in `values`; `typed`: values read from a file (`_coerce`)."""
    types_ = _field_types(type(obj))
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in types_:
            known = ", ".join(sorted(types_))
            raise ConfigError(f"unknown config field {shown(name)}{_field_hint(key, prefix, types_)}; known fields "
                              f"here: {known}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a table of fields, got {shown(value)}")
            _apply(current, value, name, typed)
        else:
            setattr(obj, key, _coerce(value, types_[key], name, typed))


def _field_hint(key: str, prefix: str, here: dict[str, Any]) -> str:
    """A did-you-mean for the unknown field `key` under `prefix`: a close name here, else the same or a close name
    in another section (`lr` at the top level: train.lr; `train.hidden`: model.hidden)."""
    if not isinstance(key, str):
        return ""
    elsewhere = {f.name.lower(): f"{section}.{f.name}" for section, cls in _field_types(Config).items()
                 if dataclasses.is_dataclass(cls) and section != prefix for f in dataclasses.fields(cls)}
    for names in ({name.lower(): f"{prefix}.{name}" if prefix else name for name in here}, elsewhere):
        close = difflib.get_close_matches(key.lower(), list(names), n=1, cutoff=0.7)
        if close:
            return f" (did you mean {shown(names[close[0]])}?)"
    return ""


CONFIG_MAX_BYTES = 1 << 20  # a config, grid or hardware file: far more than any real one
CONFIG_MAX_DEPTH = 16  # levels of nested tables and lists (a config has 2, a grid 4)
CONFIG_MAX_NODES = 100_000  # YAML values after alias expansion: a few lines of nested aliases expand to billions


def load_file(path: str | Path, what: str = "config file", suffix: str | None = None,
              unique_keys: bool = True) -> dict[str, Any]:
    """Read a TOML, YAML or JSON file (a config, or `what` the caller names in errors; `suffix` ".toml" reads any name
    as TOML) into a plain dict, within CONFIG_MAX_BYTES, CONFIG_MAX_DEPTH levels and (YAML) CONFIG_MAX_NODES values
    after alias expansion; a key given twice in one table is refused (`unique_keys`; TOML refuses it itself), not
    read as its last value. A file written by other software (a Hugging Face config.json) passes
    unique_keys=False and reads as that software reads it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {shown(str(path))} does not exist or is not a file")
    suffix = suffix or path.suffix
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"{what} {shown(str(path))} must end in .toml, .yaml, .yml or .json")
    size = path.stat().st_size
    if size > CONFIG_MAX_BYTES:
        raise ConfigError(f"{what} {shown(str(path))} is {size:,} bytes; a config file may hold at most "
                          f"{CONFIG_MAX_BYTES:,} bytes")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {shown(str(path))} cannot be read as UTF-8 text: {shown(e)}") from None
    return parse_text(text, suffix, f"{what} {shown(str(path))}", unique_keys)


def parse_text(text: str, suffix: str, where: str, unique_keys: bool = True) -> dict[str, Any]:
    """A mapping from the TOML, YAML or JSON `text` (`suffix` names the format), nested at most CONFIG_MAX_DEPTH
    deep, no key twice in one table (`unique_keys`, `load_file`); `where` names the source in errors."""
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = _load_yaml(text, where, unique_keys)
        else:
            data = json.loads(text, object_pairs_hook=(lambda pairs: _unique_pairs(pairs, where)) if unique_keys
                              else None)
    except RecursionError:
        raise ConfigError(f"{where} is nested deeper than {CONFIG_MAX_DEPTH} levels of tables and lists") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where} is not valid: {shown(e)}") from None
    except Exception as e:  # yaml.YAMLError without importing yaml at module level
        if type(e).__module__.startswith("yaml"):
            raise ConfigError(f"{where} is not valid YAML: {shown(e)}") from None
        raise
    if data is None and suffix != ".json":
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a mapping (sections and fields) at the top level, not a "
                          f"{type(data).__name__}")
    if _depth(data) > CONFIG_MAX_DEPTH:
        raise ConfigError(f"{where} is nested deeper than {CONFIG_MAX_DEPTH} levels of tables and lists")
    return data


def _unique_pairs(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """A JSON object whose keys are all different: json (as YAML) keeps the last of a key given twice, silently
    dropping what the first one said."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{where} gives {shown(key)} twice in one object; keep one (the first would be "
                              "silently dropped)")
        out[key] = value
    return out


def _depth(data: Any) -> int:
    """Levels of nested dicts and lists in `data` (iterative: a deep value must not overflow the stack)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, level = todo.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, level)
            if level <= CONFIG_MAX_DEPTH:
                todo.extend((v, level + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def _load_yaml(text: str, where: str, unique_keys: bool = True) -> Any:
    """Safe YAML within the bounds: the parser's events (a loop, no recursion) bound the depth before the composer
    (recursive) runs, and the composed graph's size with every alias expanded is counted, shared nodes once each,
    before anything is constructed."""
    import yaml

    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > CONFIG_MAX_DEPTH:
                raise ConfigError(f"{where} is nested deeper than {CONFIG_MAX_DEPTH} levels of tables and lists")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is None:
        return None
    expanded: dict[int, int] = {}  # values under each node with its aliases expanded, each node counted once
    open_nodes: set[int] = set()
    todo: list[tuple[Any, bool]] = [(node, False)]
    while todo:  # post-order: a node's count after its children's
        n, children_done = todo.pop()
        if children_done:
            open_nodes.discard(id(n))
            expanded[id(n)] = min(1 + sum(expanded[id(c)] for c in _yaml_children(n)), CONFIG_MAX_NODES + 1)
            continue
        if id(n) in open_nodes:
            raise ConfigError(f"{where} holds a YAML alias inside the value it refers to (a recursive structure)")
        if id(n) not in expanded:
            if unique_keys and isinstance(n, yaml.MappingNode):
                _unique_yaml_keys(n, where)
            expanded[id(n)] = 0
            open_nodes.add(id(n))
            todo.append((n, True))
            todo.extend((c, False) for c in _yaml_children(n))
    if expanded[id(node)] > CONFIG_MAX_NODES:
        raise ConfigError(f"{where} expands to more than {CONFIG_MAX_NODES:,} values once its YAML aliases (*name) "
                          "are replaced by what they refer to; write the values out or use fewer nested aliases")
    loader = yaml.SafeLoader("")  # the values of the node already composed (safe tags only), not a third parse
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _unique_yaml_keys(node: Any, where: str) -> None:
    """A YAML mapping whose keys are all different: PyYAML keeps the last of a key given twice (a second `train:`
    replaces the whole first section), silently dropping what the first one said. Merge keys (<<) may repeat."""
    seen: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if not hasattr(key, "tag") or not isinstance(key.value, str) or key.value == "<<":
            continue
        line, named = key.start_mark.line + 1, (key.tag, key.value)
        if named in seen:
            raise ConfigError(f"{where} gives {shown(key.value)} twice in one mapping (lines {seen[named]} and "
                              f"{line}); keep one (the first would be silently dropped)")
        seen[named] = line


def _yaml_children(node: Any) -> list[Any]:
    value = node.value if isinstance(node.value, list) else []
    return [c for item in value for c in (item if isinstance(item, tuple) else (item,))]


def build_config(
    file: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    preset: str | None = None,
) -> Config:
    """Defaults, then a model preset, then the file, then dotted overrides (`{"layout.dp": "2"}`)."""
    from fivefold.presets import get_preset

    cfg = Config()
    data = load_file(file) if file else {}
    overrides = dict(overrides or {})
    model_section = data.get("model") if isinstance(data.get("model"), dict) else {}
    # the command line's preset over the file's (both taken out: neither is a field of the model)
    file_preset = model_section.pop("preset", None)
    preset = overrides.pop("model.preset", None) or file_preset or preset
    if preset:
        cfg.model = get_preset(str(preset))
    apply_dict(cfg, data)
    apply_overrides(cfg, overrides)
    return cfg


def apply_dict(cfg: Config, data: dict[str, Any]) -> None:
    """Set the fields named in a nested dict (as read from a config file: integers and booleans must be typed as
    such, not quoted strings; the command line's strings go through `apply_overrides`)."""
    _apply(cfg, data, "", typed=True)


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> None:
    """Set dotted fields, e.g. `{"layout.dp": "2", "train.lr": "1e-3"}`."""
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        _apply(cfg, _nest(parents, {leaf: value}), "")


def _nest(parents: list[str], leaf: dict[str, Any]) -> dict[str, Any]:
    for p in reversed(parents):
        leaf = {p: leaf}
    return leaf


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    _apply(cfg, data, "")
    return cfg


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, read 16 MiB at a time (checkpoint manifests, dataset shards)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def missing_dirs(path: Path) -> tuple[list[Path], Path]:
    """The directories from `path` up that do not exist (deepest first), and the nearest that does."""
    missing: list[Path] = []
    top = path.absolute()
    while not top.exists() and top.parent != top:
        missing.append(top)
        top = top.parent
    return missing, top


def check_writable_dir(path: str | Path, flag: str) -> None:
    """A directory can be created (with its missing parents) and written at `path`: checked by creating what is
    missing and a probe file, then removing them all, so the check leaves nothing behind; a ConfigError naming
    `flag` if not (an empty path too: it would mean the current directory)."""
    if not str(path):
        raise ConfigError(f"{flag} '' is empty; give a directory (e.g. out/), or . for the current one")
    path = Path(path)
    missing, top = missing_dirs(path)  # `top` is `path` itself when it exists: a file there is refused below
    if not top.is_dir():
        raise ConfigError(f"{flag} {shown(str(path))}: {shown(str(top))} is a file, not a directory; choose a "
                          "directory under a writable directory")
    try:
        for p in reversed(missing):
            p.mkdir()
        probe = path / ".fivefold-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag} {shown(str(path))} cannot be created or written ({e.strerror or e}); choose a "
                          "directory under a writable directory") from None
    finally:
        for p in missing:  # as we found it
            try:
                p.rmdir()
            except OSError:
                pass


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: into a temporary file beside it, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def dump_toml(cfg: Config) -> str:
    """Serialise a config as TOML (enough of TOML for our flat sections)."""
    lines: list[str] = []
    top = cfg.to_dict()
    for key, value in top.items():
        if not isinstance(value, dict) and value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    for section, values in top.items():
        if not isinstance(values, dict):
            continue
        lines.append(f"\n[{section}]")
        # TOML has no null: a field left out reads back as its default, which is None for every optional field
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def parse_overrides(extra: list[str]) -> dict[str, str]:
    """`["--layout.dp", "2", "--train.lr=1e-3"]` -> `{"layout.dp": "2", "train.lr": "1e-3"}`."""
    out: dict[str, str] = {}
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(
                f"unrecognized argument {shown(arg)}; config fields are given as --section.field VALUE "
                "(e.g. --layout.dp 2); see `fivefold train --help`"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ConfigError(f"{arg} needs a value")
            value = extra[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out
