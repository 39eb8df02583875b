"""Attention kernels that return the log-sum-exp (LSE) of each query row, with their backward.

Ring attention merges the partial outputs of several key/value blocks by their LSE and runs the backward
block by block with the merged output and LSE (the flash-attention recipe). No public PyTorch API returns
the LSE together with a backward, so this module is the one place that calls the underscore aten kernels
behind `scaled_dot_product_attention`: the CPU flash kernel on CPU, the memory-efficient kernel (fp32, fp16
and bf16, any head dim it supports) on accelerators. The kernel is chosen from the tensors' device type.

Shapes: q [batch, heads, q_len, head_dim]; k, v [batch, kv_heads, kv_len, head_dim] with heads a multiple
of kv_heads (grouped-query attention); out like q; lse [batch, heads, q_len] in fp32. `causal=True` needs
q_len == kv_len (the diagonal block), so that the mask's alignment cannot be mistaken.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _check(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal block needs as many queries as keys, got {q.shape[2]} and {k.shape[2]}")


def expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat each key/value head for its group of query heads (the layout SDPA's enable_gqa uses)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def sum_kv_head_grads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradient of repeated heads back onto their key/value head."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block: (out, lse)."""
    _check(q, k, causal)
    if q.device.type == "cpu":  # the CPU kernel handles grouped-query heads itself
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return out, lse[:, :, : q.shape[2]]  # the efficient kernel pads the LSE's length


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block, given the output and LSE of the whole (merged) attention row.

    With a block's own out and lse this is the plain attention backward; with the merged ones it is that
    block's share of the full backward, as flash attention computes it tile by tile."""
    _check(q, k, causal)
    grad_out = grad_out.contiguous()
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq, dk, dv
    kv_heads = k.shape[1]
    k, v = expand_kv_heads(k, q.shape[1]), expand_kv_heads(v, q.shape[1])
    sq = q.shape[2]
    no_seed = torch.zeros((), dtype=torch.int64)  # no dropout: a host placeholder, as the forward returns
    padded = (sq + 31) // 32 * 32  # the LSE length the efficient kernel produced and expects back
    lse = torch.nn.functional.pad(lse, (0, padded - sq)) if padded != sq else lse
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse.contiguous(), no_seed, no_seed, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, sum_kv_head_grads(dk, kv_heads), sum_kv_head_grads(dv, kv_heads)
