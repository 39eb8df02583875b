"""The LSE attention kernels and the ring's block merge on every device this machine has: the CPU always, the
accelerator (CUDA, XPU, ...) when there is one, which takes the other kernel path of `attention_ops`. In CI only
the CPU runs; on a GPU machine `python -m pytest tests/test_attention_devices.py` checks the kernels that ring
attention uses there, against float64 softmax attention computed on the CPU.

Tolerances: fp32 inputs; the accelerator kernels may use other tile orders, and fp32 matmuls there may use
reduced-precision inner products, so 2e-4 absolute on outputs and gradients of order 1 (ten times the CPU's
rounding); a wrong mask, scale, head grouping or merge moves them by order 1e-1.
"""

from __future__ import annotations

import pytest
import torch

from fivefold.parallel.attention_ops import attention_backward, attention_forward
from fivefold.parallel.context import _merge

DEVICES = ["cpu"]
if torch.accelerator.is_available():
    DEVICES.append(torch.accelerator.current_accelerator().type)
ATOL = 2e-4


def reference(q, k, v, causal_offset: int | None):
    """float64 softmax attention on the CPU: (out, lse, grads of sum(out * grad_out)). `causal_offset` is the
    position of the first query relative to the first key (None: no mask)."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal_offset is not None:
        rows = torch.arange(q.shape[2])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[2])[None, :] > rows, float("-inf"))
    out = scores.softmax(-1) @ vv
    return out, scores.logsumexp(-1), (q, k, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_block_kernels_match_softmax(device, kv_heads):
    torch.manual_seed(0)
    for causal, kv_len in ((True, 48), (False, 80)):
        q = torch.randn(2, 4, 48, 32, device=device)
        k, v = torch.randn(2, kv_heads, kv_len, 32, device=device), torch.randn(2, kv_heads, kv_len, 32, device=device)
        out, lse = attention_forward(q, k, v, causal)
        ref_out, ref_lse, leaves = reference(q, k, v, 0 if causal else None)
        torch.testing.assert_close(out.cpu().double(), ref_out.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(lse.cpu().double(), ref_lse.detach(), atol=ATOL, rtol=0)
        grad_out = torch.randn_like(out)
        expected = torch.autograd.grad(ref_out, leaves, grad_out.cpu().double())
        got = attention_backward(grad_out, q, k, v, out, lse, causal)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g.cpu().double(), e, atol=ATOL, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_two_key_blocks_merged_by_lse_equal_one_causal_attention(device):
    """What ring attention does on each rank, in one process: the queries of a late chunk against an earlier key
    chunk (a full block) and against their own chunk (a causal block), merged by log-sum-exp; the backward of
    each block with the merged output and LSE, summed."""
    torch.manual_seed(1)
    c = 40
    q = torch.randn(1, 4, c, 32, device=device)
    k, v = torch.randn(1, 2, 2 * c, 32, device=device), torch.randn(1, 2, 2 * c, 32, device=device)
    early, own = slice(0, c), slice(c, 2 * c)
    out = torch.zeros(1, 4, c, 32, device=device)
    lse = torch.full((1, 4, c), float("-inf"), device=device)
    rows = slice(0, c)
    for cols, causal in ((early, False), (own, True)):
        block_out, block_lse = attention_forward(q, k[:, :, cols], v[:, :, cols], causal)
        _merge(out, lse, (slice(None), slice(None), rows), block_out, block_lse)
    ref_out, ref_lse, leaves = reference(q, k, v, c)
    torch.testing.assert_close(out.cpu().double(), ref_out.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(lse.cpu().double(), ref_lse.detach(), atol=ATOL, rtol=0)

    grad_out = torch.randn_like(out)
    expected = torch.autograd.grad(ref_out, leaves, grad_out.cpu().double())
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for cols, causal in ((early, False), (own, True)):
        bq, bk, bv = attention_backward(grad_out, q, k[:, :, cols], v[:, :, cols], out, lse, causal)
        dq += bq
        dk[:, :, cols] += bk
        dv[:, :, cols] += bv
    for g, e in zip((dq, dk, dv), expected, strict=True):
        torch.testing.assert_close(g.cpu().double(), e, atol=ATOL, rtol=0)
