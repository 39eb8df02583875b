"""Activation recomputation (`torch.utils.checkpoint`, non-reentrant), applied to the plain or tensor-parallel
`Llama` in place:

- `none`: every activation that backward needs is kept.
- `selective`: each block is checkpointed with an op-level policy (`create_selective_checkpoint_contexts`):
  the outputs of the matmuls that carry weights (`aten::mm`, `aten::addmm`: the q/k/v, o, gate/up and down
  projections) and of the fused attention kernels (output and log-sum-exp) are kept; the cheap element-wise work
  (the RMSNorms, rotary, SiLU and the SwiGLU product, the residual adds, autocast's casts) is recomputed in
  backward from the block input and those outputs. Batched matmuls (the math attention kernel's scores, the MoE
  experts) and collectives are recomputed too, except those kept (below). Per token and layer this keeps
  h + 2 h + (2 H + 2 Hkv) d + 2 f values (input, o and down outputs, q k v and attention output, gate and up)
  plus the fp32 log-sum-exp, instead of the norms' inputs, statistics, normalised and scaled copies, the rotated
  q and k and the four f-sized SwiGLU tensors (docs/parallelism.md).
- `full`: each block is recomputed in backward from its input; only the block inputs are kept.

Under tensor / sequence parallelism full recompute repeats the block's forward communication (all-reduce or
all-gather) in backward, the same on every tp rank; so does selective recompute, except for the overlapped
sequence-parallel linears (`layout.tp_comm_overlap`), whose collectives it does not run again: the row linears'
reduce-scattered outputs are kept (1/tp of the sequence each) and the gathered linears' matmuls come from the
checkpoint's cache (`tensor_comm.CollectiveStore`); for ring attention (context parallel), whose output and
log-sum-exp it keeps in the same store (`context.RingAttention`); and for the expert-parallel exchanges, whose
received counts, rows and outputs it keeps there too (`expert.ExpertParallelDispatch`). Apply after tensor
parallelism. The
recomputed forward is the same code on the same inputs, so gradients are unchanged. Under expert parallelism
the recomputed dispatch reuses the count tables that its original forward read on the host (see
`host_counts_kept`), so recompute adds no host synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fivefold.config import shown
from fivefold.models.llama import Llama, MoE
from fivefold.parallel.context import RingAttentionCore
from fivefold.parallel.expert import ExpertParallelDispatch
from fivefold.parallel.tensor_comm import CollectiveStore, computing_kept_whole

RECOMPUTE_MODES = ("none", "selective", "full")

# kept under selective recompute: the weight matmuls (float8's `_scaled_mm` too) and the fused attention kernels (by
# operator name, so that no private operator handle is needed; the names are those of torch 2.11 to 2.13 on CPU and GPU)
SAVED_OPS = ("aten::mm", "aten::addmm", "aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
             "aten::_efficient_attention_forward")


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the matmul and attention outputs, recompute everything else (nothing of the work whose result a
    `CollectiveStore` keeps whole: `tensor_comm.computing_kept_whole`)."""
    if computing_kept_whole():
        return CheckpointPolicy.PREFER_RECOMPUTE
    name = op.name().split(".")[0]
    return CheckpointPolicy.MUST_SAVE if name in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


@contextlib.contextmanager
def host_counts_kept(block: nn.Module, store: list, replay: bool,
                     inner: contextlib.AbstractContextManager) -> Iterator[None]:
    """Within `inner`: the MoE layer of `block` appends the count tables that its expert-parallel dispatch reads on
    the host to `store` (the original forward), or takes them from `store` instead of reading them again (the
    recomputation, `replay`)."""
    moe = block.mlp if isinstance(block.mlp, MoE) else None
    with inner:
        if moe is not None:
            moe.replayed_counts, moe.recorded_counts = (list(store), None) if replay else (None, store)
        try:
            yield
        finally:
            if moe is not None:
                moe.replayed_counts = moe.recorded_counts = None


def store_holders(block: nn.Module) -> list:
    """What in `block` keeps its collectives' outputs in a `CollectiveStore` (each has a `collective_store`): the
    overlapped tensor-parallel modules, ring attention's core, an expert-parallel MoE layer's dispatch."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    holders = [m for m in (attn, mlp) if getattr(m, "tp_comm_overlap", False)]
    holders += [h for h in (getattr(attn, "core", None), getattr(mlp, "dispatch_combine", None))
                if isinstance(h, RingAttentionCore | ExpertParallelDispatch)]
    return holders


@contextlib.contextmanager
def collectives_kept(block: nn.Module, store: CollectiveStore | None, replay: bool,
                     inner: contextlib.AbstractContextManager) -> Iterator[None]:
    """Within `inner`: the overlapped tensor-parallel modules of `block`, its ring attention and its expert-parallel
    MoE layer keep their collectives' outputs in `store` (the original forward) or take them from it without
    communicating (the selective recomputation, `replay`); see `tensor_comm.CollectiveStore`,
    `context.RingAttention` and `expert.ExpertParallelDispatch`. Nothing without a store (full recompute
    communicates again)."""
    modules = store_holders(block) if store is not None else []
    with inner:
        for m in modules:
            m.collective_store = store
        if store is not None:
            store.replay = replay
        try:
            yield
        finally:
            for m in modules:
                m.collective_store = None


def block_contexts(block: nn.Module, selective: bool) -> tuple:
    """`checkpoint`'s context_fn for `block`: the selective policy's contexts (or none) around the recording of
    the host count tables and of the tensor-parallel collectives' outputs in the original forward and their replay
    in the recomputation. The stores are made per checkpointed call, so every recomputation reads those of its own
    forward."""
    forward, recompute = selective_contexts() if selective else (contextlib.nullcontext(), contextlib.nullcontext())
    store: list = []
    kept = CollectiveStore() if selective else None
    return (host_counts_kept(block, store, False, collectives_kept(block, kept, False, forward)),
            host_counts_kept(block, store, True, collectives_kept(block, kept, True, recompute)))


def apply_recompute(model: Llama, mode: str) -> None:
    """Make `model`'s blocks recompute activations in backward according to `mode` (none | selective | full)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"layout.recompute = {shown(mode)} is not a recompute mode; choose one of {RECOMPUTE_MODES}")
    if getattr(model, "recompute_mode", "none") != "none":
        raise ValueError(f"recompute is already applied to this model ({shown(model.recompute_mode)})")
    model.recompute_mode = mode
    for block in model.layers.values():
        if mode in ("selective", "full"):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False,
                                              context_fn=functools.partial(block_contexts, block, mode == "selective"))
