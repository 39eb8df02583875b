"""Recompute none / selective / full on one block: the bytes it holds for backward per token, against the closed
forms of docs/parallelism.md, and gradients identical to no recompute (fp32, CPU).

What is measured: the distinct storages that the forward leaves alive for backward, parameters and the block's
input and output excluded. Autograd's saved tensors are seen with `torch.autograd.graph.saved_tensors_hooks`;
checkpoint's saved inputs go through autograd and are seen there too, but selective recompute keeps the outputs
it saves in the checkpoint's own cache, out of autograd's sight, so the tensors that the forward created and
that are still alive afterwards (found with `gc`) are added, except the checkpoint's saved generator state (a
constant per block). Measured at two token counts, per token = the difference / the tokens' difference.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable

import pytest
import torch

from fivefold.models.llama import Block, rope_cos_sin
from fivefold.parallel.recompute import apply_recompute
from fivefold.presets import get_preset


def live_storages() -> dict[int, int]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return dict(filter(None, (_storage(t) for t in tensors if t.device.type != "meta")))


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for one whose storage is no longer valid (a tensor left in the
    heap by an earlier test, whose storage was freed under it: it holds nothing either side of a measurement)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return None


def held_bytes(run: Callable[[], torch.Tensor], exclude: set[int]) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages that `run`'s forward keeps for backward (see the module docstring), except
    the storages in `exclude`; and `run`'s output (whose storage is excluded too)."""
    before = live_storages()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    rng = torch.get_rng_state().nbytes  # the checkpoint's saved CPU generator state: 5 KB per block, not counted
    for ptr, nbytes in live_storages().items():
        if ptr not in before and nbytes != rng:
            seen.setdefault(ptr, nbytes)
    skip = exclude | {out.untyped_storage().data_ptr()}
    return sum(n for ptr, n in seen.items() if ptr not in skip), out


class Shell(torch.nn.Module):
    """One block under `layers`, as `apply_recompute` expects of a model."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": Block(cfg)})


def block_bytes_and_grads(cfg, mode: str, rows: int, seq: int) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    shell = Shell(cfg)
    apply_recompute(shell, mode)
    block = shell.layers["0"]
    x = torch.randn(rows, seq, cfg.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    cos, sin = rope_cos_sin(cfg, torch.arange(seq))
    exclude = {t.untyped_storage().data_ptr() for t in [x, cos, sin, *block.parameters()]}
    held, out = held_bytes(lambda: block(x, cos, sin), exclude)
    out.pow(2).sum().backward()
    grads = {n: p.grad for n, p in block.named_parameters()} | {"input": x.grad}
    return held, grads


def closed_form(cfg, mode: str) -> int:
    """Bytes per token per layer that a dense block keeps in fp32 (docs/parallelism.md, "Selective recompute")."""
    h, f, d, heads, kv = cfg.hidden, cfg.ffn, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    attn = 2 * heads * d + 2 * kv * d  # q (rotated), k (rotated), v, the attention output
    lse = 4 * heads  # fp32 log-sum-exp of the flash kernel
    if mode == "none":  # 2 norms x (input, output, 1/rms); o_proj reads the kernel's output
        return 4 * (2 * (2 * h + 1) + attn + 4 * f) + lse  # SwiGLU: gate, up, silu(gate), silu(gate) * up
    if mode == "selective":  # block input; q, k, v, attention, o, gate, up, down outputs
        return 4 * (h + attn + h + 2 * f + h) + lse
    return 4 * h  # full: the block input only (excluded from the measurement: it is the previous block's output)


SHAPES = {"tiny": get_preset("tiny"), "llama-3.2-1b": get_preset("llama-3.2-1b")}


@pytest.mark.parametrize("preset", list(SHAPES))
def test_block_bytes_per_token_match_the_closed_form_and_grads_match(preset):
    cfg = dataclasses.replace(SHAPES[preset], n_layers=1)
    rows, seq = (2, 16) if preset == "tiny" else (1, 8)
    per_token = {}
    for mode in ("none", "selective", "full"):
        small, grads = block_bytes_and_grads(cfg, mode, rows, seq)
        large, _ = block_bytes_and_grads(cfg, mode, 2 * rows, seq)
        per_token[mode] = (large - small) / (rows * seq)
        if mode == "none":
            reference = grads
        else:
            for name, g in grads.items():
                assert torch.equal(g, reference[name]), (mode, name)
    # the block input is excluded (the caller holds it); selective and full keep it, none keeps it in its norm
    expected = {mode: closed_form(cfg, mode) - 4 * cfg.hidden for mode in per_token}
    assert per_token == expected, (preset, per_token)
    assert per_token["full"] == 0 < per_token["selective"] < 0.7 * per_token["none"]
