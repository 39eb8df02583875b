"""The chunked linear cross-entropy against PyTorch's cross-entropy on materialised logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fivefold.models.loss import linear_cross_entropy_sum


@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_matches_reference_loss_and_grads(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 9))
    targets[0, 3] = -100
    ref = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100)
    ref_gh, ref_gw = torch.autograd.grad(ref * 0.37, (hidden, weight))
    ours = linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad(ours * 0.37, (hidden, weight))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-4, atol=1e-6)


def test_no_grad_path():
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    targets = torch.randint(0, 11, (5,))
    with torch.no_grad():
        ours = linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens=2)
    ref = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    torch.testing.assert_close(ours, ref)


@pytest.mark.slow
def test_compiled_chunk_matches_eager():
    """The `torch.compile`d softmax pass (train.compile) gives the eager loss and gradients."""
    torch.manual_seed(1)
    hidden = torch.randn(24, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (24,))
    targets[5] = -100
    results = []
    for compiled in (False, True):
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_tokens=8, compiled=compiled)
        results.append((loss, *torch.autograd.grad(loss, (hidden, weight))))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)  # fused vs separate rounding
