"""Cross-entropy fused with the output layer, chunked over tokens, so that the fp32 logits of the whole
batch ([tokens, vocab], 2 GB per 4096-token sequence at a 128k vocabulary) never exist at once.

The forward pass computes, chunk by chunk, the logits, the summed loss and already the gradients with
respect to the hidden states and the output weight (softmax minus one-hot); backward only scales them by
the incoming gradient. Only one chunk's logits are alive at a time.
"""

from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                compute_dtype: torch.dtype) -> torch.Tensor:
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = weight.to(compute_dtype)
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk].to(compute_dtype)
            t = targets[start:start + chunk]
            logits = (h @ w.t()).float()
            valid = t != -100
            safe_t = torch.where(valid, t, 0)
            log_probs = torch.log_softmax(logits, dim=-1)
            picked = log_probs.gather(1, safe_t[:, None]).squeeze(1)
            total -= (picked * valid).sum()
            if needs_grad:
                g = log_probs.exp_()  # softmax, in place of the log-probabilities
                g.scatter_add_(1, safe_t[:, None], -torch.ones_like(picked)[:, None])
                g *= valid[:, None]
                g = g.to(compute_dtype)
                grad_hidden[start:start + chunk] = (g @ w).to(hidden.dtype)
                grad_weight += (g.t() @ h).float()
        if needs_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out, grad_weight * grad_out, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk_tokens: int = 4096, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets` (-100 ignored), in chunks of tokens.

    `hidden` is [..., hidden], `weight` is [vocab, hidden]; the matmuls run in `compute_dtype` (default:
    the hidden states' dtype), the softmax in fp32."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropy.apply(hidden, weight, targets.reshape(-1), chunk_tokens,
                                     compute_dtype or hidden.dtype)
