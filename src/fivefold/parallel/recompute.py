"""Activation recomputation (`torch.utils.checkpoint`, non-reentrant), applied to the plain or tensor-parallel
`Llama` in place:

- `none`: every activation that backward needs is kept.
- `selective`: only the attention core (`Attention.core`, the SDPA call) is recomputed in backward; its
  inputs q, k, v are kept, its output and softmax statistics (or the attention matrix with the math kernel)
  are not. Cheap to recompute relative to the memory it frees, as in Korthikanti et al.
- `full`: each block is recomputed in backward from its input; only the block inputs are kept. Under tensor
  / sequence parallelism the recompute repeats the block's forward communication (all-reduce or
  all-gather) in backward, the same on every tp rank.

Apply after tensor parallelism. The recomputed forward is the same code on the same inputs, so gradients
are unchanged.
"""

from __future__ import annotations

import functools

from torch.utils.checkpoint import checkpoint

from fivefold.models.llama import Llama

RECOMPUTE_MODES = ("none", "selective", "full")


def apply_recompute(model: Llama, mode: str) -> None:
    """Make `model`'s blocks recompute activations in backward according to `mode` (none | selective | full)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"layout.recompute = {mode!r} is not a recompute mode; choose one of {RECOMPUTE_MODES}")
    if getattr(model, "recompute_mode", "none") != "none":
        raise ValueError(f"recompute is already applied to this model ({model.recompute_mode!r})")
    model.recompute_mode = mode
    for block in model.layers.values():
        if mode == "selective":
            # instance attribute: `Attention.forward` calls `self.core`, which now checkpoints the kernel
            block.attn.core = functools.partial(checkpoint, block.attn.core, use_reentrant=False)
        elif mode == "full":
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
