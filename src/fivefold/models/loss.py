"""Cross-entropy fused with the output layer, chunked over tokens, so that the fp32 logits of the whole
batch ([tokens, vocab], 2 GB per 4096-token sequence at a 128k vocabulary) never exist at once.

The forward pass computes, chunk by chunk, the logits, the summed loss and already the gradients with
respect to the hidden states and the output weight (softmax minus one-hot); backward only scales them by
the incoming gradient. Only one chunk's logits are alive at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fivefold.layout import LOSS_CHUNK_TOKENS  # beside the layout rules, which the planner reads without torch

if TYPE_CHECKING:
    from fivefold.models.llama import Llama


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, need_grad: bool,
                        grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross-entropy of one chunk's logits [tokens, vocab] (targets of -100 ignored) and, from the same
    pass, its gradient with respect to the logits (softmax minus one-hot) in `grad_dtype`. In fp32 whatever the
    logits' dtype; in place after the one fp32 copy, so that eager mode makes no further [tokens, vocab] tensor
    and `torch.compile` fuses it into a reduction and one elementwise pass."""
    logits = logits.float()
    valid = targets != -100
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    if not need_grad:
        return loss, None
    grad = logits.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad.mul_(valid[:, None])
    return loss, grad.to(grad_dtype)


_compiled: dict[str, object] = {}  # the compiled chunk function, built on first use


def _chunk_function(compiled: bool):
    if not compiled:
        return chunk_loss_and_grad
    if "chunk" not in _compiled:
        _compiled["chunk"] = torch.compile(chunk_loss_and_grad, dynamic=False)
    return _compiled["chunk"]


def chunked_output_loss(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                        compute_dtype: torch.dtype, chunk_loss) -> torch.Tensor:
    """The forward of a chunked output layer + loss (an autograd Function's `ctx`): for each chunk of tokens,
    `chunk_loss(h, w, t, needs_grad)` returns the chunk's summed loss and the gradient of its logits (`h @ w.T`,
    h and w in `compute_dtype`), from which the gradients of `hidden` and `weight` are accumulated and saved for
    `scaled_saved_gradients`."""
    needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    w = weight.to(compute_dtype)
    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if needs_grad else None
    grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if needs_grad else None
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk].to(compute_dtype)
        loss, g = chunk_loss(h, w, targets[start:start + chunk], needs_grad)
        total += loss
        if needs_grad:
            grad_hidden[start:start + chunk] = (g @ w).to(hidden.dtype)
            grad_weight += (g.t() @ h).float()
    if needs_grad:
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
    return total


def scaled_saved_gradients(ctx, grad_out: torch.Tensor, other_inputs: int) -> tuple:
    """The backward of `chunked_output_loss`: the saved gradients of hidden and weight times the incoming one,
    and None for each of the Function's `other_inputs`."""
    grad_hidden, grad_weight = ctx.saved_tensors
    return grad_hidden * grad_out, grad_weight * grad_out, *([None] * other_inputs)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                compute_dtype: torch.dtype, compiled: bool) -> torch.Tensor:
        chunk_fn = _chunk_function(compiled)
        return chunked_output_loss(ctx, hidden, weight, targets, chunk, compute_dtype,
                                   lambda h, w, t, grad: chunk_fn(h @ w.t(), t, grad, compute_dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return scaled_saved_gradients(ctx, grad_out, 4)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk_tokens: int = LOSS_CHUNK_TOKENS, compute_dtype: torch.dtype | None = None,
                             compiled: bool = False) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets` (-100 ignored), in chunks of tokens.

    `hidden` is [..., hidden], `weight` is [vocab, hidden]; the matmuls run in `compute_dtype` (default:
    the hidden states' dtype), the softmax in fp32. `compiled` runs each chunk's softmax through
    `torch.compile` (one fused pass over the logits instead of several)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return _LinearCrossEntropy.apply(hidden, weight, targets.reshape(-1), chunk_tokens,
                                     compute_dtype or hidden.dtype, compiled)


def model_loss_sum(model: Llama, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                   compute_dtype: torch.dtype, compiled: bool = False) -> torch.Tensor:
    """Summed token loss of `model` on a micro-batch (`positions`: the rotary positions of the tokens, None for
    0..seq-1): its hidden states, then the fused chunked output layer + loss. The single-device engine and the
    parallel loss module (without tensor parallel) both compute the loss through this function."""
    hidden = model.forward_hidden(inputs, positions)
    return linear_cross_entropy_sum(hidden, model.lm_head.weight, targets, LOSS_CHUNK_TOKENS, compute_dtype, compiled)
