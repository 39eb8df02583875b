"""Compute measurements of `fivefold calibrate`: linear layers, attention and the fused output layer + loss by
shape (TFLOP/s), element-wise bandwidth by size, the fixed cost of an operator, and the optimizer step."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from fivefold.config import TrainConfig
from fivefold.models.loss import linear_cross_entropy_sum
from fivefold.tools.calibrate.harness import (
    COLD_SPAN_BYTES,
    Clock,
    Say,
    operand_sets,
    size_text,
    tflops,
    time_forward_backward,
)
from fivefold.train.optim import build_adamw


def measure_linear(clock: Clock, shapes, dtype: torch.dtype, say: Say) -> list[list[float]]:
    rows = []
    for i, (m, n, k) in enumerate(shapes):
        def make(m=m, n=n, k=k):
            x = torch.randn(1, m, k, device=clock.device, dtype=dtype, requires_grad=True)
            w = (torch.randn(n, k, device=clock.device, dtype=dtype) * 0.02).requires_grad_()
            g = torch.randn(1, m, n, device=clock.device, dtype=dtype)
            return (lambda: F.linear(x, w)), [x, w], g

        rows.append([m, n, k, *tflops(clock, make, 2 * (m * k + n * k + m * n) * dtype.itemsize, 2 * m * n * k)])
        if (i + 1) % 10 == 0 or i + 1 == len(shapes):
            say(f"linear {i + 1}/{len(shapes)} (last {m}x{n}x{k}: forward {rows[-1][3]:.3g}, backward "
                f"{rows[-1][4]:.3g} TFLOP/s)")
    return rows


def measure_attention(clock: Clock, shapes, dtype: torch.dtype, say: Say) -> list[list[float]]:
    rows = []
    for b, h, kvh, s, d in shapes:
        def make(b=b, h=h, kvh=kvh, s=s, d=d):
            q = torch.randn(b, h, s, d, device=clock.device, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(b, kvh, s, d, device=clock.device, dtype=dtype, requires_grad=True)
                    for _ in range(2))
            g = torch.randn(b, h, s, d, device=clock.device, dtype=dtype)
            return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != kvh)), \
                [q, k, v], g

        flops = 2 * b * h * s * s * d  # causal: half of 4 b h s^2 d
        rows.append([b * h, s, d, *tflops(clock, make, 2 * b * s * d * (3 * h + 2 * kvh) * dtype.itemsize, flops)])
    say(f"attention {len(shapes)} shapes (last {shapes[-1]}: forward {rows[-1][3]:.3g} TFLOP/s)")
    return rows


def measure_loss(clock: Clock, shapes, dtype: torch.dtype, say: Say) -> list[list[float]]:
    """The engine's fused output layer + cross-entropy on one chunk of tokens (it computes its gradients in the
    forward; the backward scales them), by (tokens, vocabulary, hidden)."""
    rows = []
    for m, n, k in shapes:
        def make(m=m, n=n, k=k):
            hidden = torch.randn(m, k, device=clock.device, dtype=dtype, requires_grad=True)
            weight = (torch.randn(n, k, device=clock.device, dtype=dtype) * 0.02).requires_grad_()
            targets = torch.randint(0, n, (m,), device=clock.device)
            return (lambda: linear_cross_entropy_sum(hidden, weight, targets, m, dtype)), [hidden, weight], \
                torch.ones((), device=clock.device, dtype=torch.float32)

        rows.append([m, n, k, *tflops(clock, make, 2 * (m * k + n * k) * dtype.itemsize, 2 * m * n * k)])
    m, n, k, fwd, bwd = rows[-1]  # TFLOP/s
    ms = 2 * m * n * k * (1 / fwd + 2 / bwd) / 1e9
    say(f"output layer + loss {len(shapes)} shapes (last {shapes[-1]}: {ms:.3g} ms)")
    return rows


OPS_PER_UNIT = 19  # operators in `_fixed_cost_unit`


def _fixed_cost_unit(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kinds of operators a block runs besides its matmuls, in about their proportions: an RMSNorm, a rotary
    rotation, views, an activation, casts and residual adds (19 operators)."""
    b, s, d = x.shape
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    y = (y * w).to(x.dtype)
    lo, hi = y.chunk(2, dim=-1)
    y = torch.cat([-hi, lo], dim=-1) * 0.5 + y
    y = y.view(b, s, 2, d // 2).transpose(1, 2).transpose(1, 2).reshape(b, s, d)
    y = F.silu(y) * y
    return y + x


def measure_fixed_cost(clock: Clock, dtype: torch.dtype, say: Say) -> tuple[float, float]:
    """Seconds per operator of the forward and of its backward, on a tiny tensor (no work to speak of)."""
    units = 10
    x = torch.randn(1, 8, 64, device=clock.device, dtype=dtype, requires_grad=True)
    w = torch.randn(64, device=clock.device, dtype=dtype, requires_grad=True)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(units):
            y = _fixed_cost_unit(y, w)
        return y.sum()

    one = (chain, [x, w], torch.ones((), device=clock.device, dtype=dtype))
    fwd, bwd = time_forward_backward(clock, lambda: one, COLD_SPAN_BYTES)  # fixed costs: one set, kept in cache
    ops = units * OPS_PER_UNIT
    say(f"operator fixed cost: forward {1e6 * fwd / ops:.1f} us, backward {1e6 * bwd / ops:.1f} us")
    return fwd / ops, bwd / ops


def measure_elementwise(clock: Clock, numels: list[int], dtype: torch.dtype, say: Say) -> list[list[float]]:
    """GB/s of a binary element-wise operator beyond its fixed cost, by the bytes of one operand (operands
    rotated through sets beyond the caches, as `time_forward_backward`)."""
    tiny = torch.ones(16, device=clock.device, dtype=dtype)
    base = clock.time(lambda: torch.mul(tiny, tiny))[0]
    rows = []
    for n in numels:
        nbytes = n * dtype.itemsize
        pairs = itertools.cycle([(torch.randn(n, device=clock.device, dtype=dtype),
                                  torch.randn(n, device=clock.device, dtype=dtype))
                                 for _ in range(operand_sets(3 * nbytes))])

        def mul(pairs=pairs) -> None:
            torch.mul(*next(pairs))

        seconds = clock.time(mul)[0]
        rows.append([nbytes, 3 * nbytes / max(seconds - base, seconds * 0.05) / 1e9])
    say("element-wise GB/s by operand size: " + ", ".join(f"{size_text(int(r[0]))} {r[1]:.3g}" for r in rows))
    return rows


def measure_optimizer(clock: Clock, numel: int, say: Say) -> tuple[float, float]:
    """The engine's optimizer step (clip the gradient norm, AdamW, zero the gradients) on fp32 parameters:
    bytes of parameters, gradients and the two moments streamed per second on one large tensor, and the cost
    per tensor on many small ones."""
    from torch import nn

    def step_time(shapes: list[int]) -> float:
        params = nn.ParameterList([nn.Parameter(torch.randn(n, 1, device=clock.device)) for n in shapes])
        grads = [torch.randn_like(p) for p in params]
        opt = build_adamw(params, TrainConfig(), clock.device)

        def step() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(params.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return clock.time(step)[0]

    tensors = 64
    big = step_time([numel])
    small = step_time([16] * tensors)
    gbps = 16 * numel / max(big - small / tensors, big * 0.05) / 1e9
    per_tensor = small / tensors
    say(f"optimizer step: {gbps:.3g} GB/s of states, {1e6 * per_tensor:.1f} us per tensor")
    return gbps, per_tensor

