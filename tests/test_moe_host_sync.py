"""Host synchronisations of the MoE layers: every read of tensor data by the host in a forward and backward,
counted per MoE layer, against the limits of the grouped implementation: none without expert parallel, one with
it (the all-to-all split sizes), none added by recompute; the padded implementation, which sizes its packed
tensor by a host read, is caught by the same counter.

The counter patches every call that makes an accelerator wait for the device (a scalar or list read, a copy to
the host, and the ops whose output shape depends on the data: nonzero, bincount, unique, masked_select, boolean
indexing, repeat_interleave without its output size), so it counts on the CPU what would be a sync on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_ranks

from fivefold.config import ModelConfig
from fivefold.models.llama import build_model, grouped_mm_runs
from fivefold.parallel.expert import apply_expert_parallel
from fivefold.parallel.recompute import apply_recompute

# methods that read tensor data on the host (on an accelerator: wait for the device, then copy)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "bincount",
         "unique", "masked_select")
LAYERS = 2


class HostReads:
    """Counts host reads of tensor data while active (`counting`)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def counted(self, name: str, original):
        def wrapper(*args, **kwargs):
            if name.endswith("repeat_interleave") and (kwargs.get("output_size") is not None
                                                       or not isinstance(args[1] if len(args) > 1 else
                                                                         kwargs.get("repeats"), torch.Tensor)):
                return original(*args, **kwargs)  # sized by the caller, or repeats given on the host
            if name.endswith("__getitem__") and not any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
                return original(*args, **kwargs)  # only a boolean mask's result size depends on the data
            self.calls.append(name)
            return original(*args, **kwargs)
        return wrapper

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostReads]:
        with pytest.MonkeyPatch.context() as patch:
            for name in (*READS, "repeat_interleave", "__getitem__"):
                patch.setattr(torch.Tensor, name, self.counted(f"Tensor.{name}", getattr(torch.Tensor, name)))
            for name in ("nonzero", "bincount", "unique", "masked_select", "repeat_interleave"):
                patch.setattr(torch, name, self.counted(f"torch.{name}", getattr(torch, name)))
            yield self


def moe_config(impl: str, capacity_factor: float = 0.0) -> ModelConfig:
    return ModelConfig(n_layers=LAYERS, hidden=32, ffn=48, n_heads=4, n_kv_heads=2, vocab_size=64, n_experts=4,
                       top_k=2, n_shared_experts=1, moe_impl=impl, capacity_factor=capacity_factor)


def reads_in_step(model: torch.nn.Module, tokens: torch.Tensor) -> list[str]:
    """The host reads of one forward and backward of `model` on `tokens` (the loss its logits' mean square plus
    the auxiliary loss, so that every path of the router has a gradient)."""
    reads = HostReads()
    with reads.counting():
        logits = model(tokens)
        (logits.square().mean() + model.moe_aux_loss()).backward()
    return reads.calls


def grouped_mm_on_cpu() -> bool:
    cfg = moe_config("grouped")
    return grouped_mm_runs("cpu", torch.float32, cfg.hidden, cfg.expert_ffn)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_grouped_moe_reads_nothing_on_the_host(recompute: str, capacity_factor: float) -> None:
    if not grouped_mm_on_cpu():
        pytest.skip("torch.nn.functional.grouped_mm does not run on this PyTorch's CPU: the loop over the experts "
                    "reads their offsets once per layer")
    model = build_model(moe_config("grouped", capacity_factor), seed=0)
    apply_recompute(model, recompute)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert reads_in_step(model, tokens) == []


def test_padded_moe_reads_on_the_host_and_the_counter_sees_it() -> None:
    model = build_model(moe_config("padded"), seed=0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    calls = reads_in_step(model, tokens)
    assert len(calls) >= 2 * LAYERS, calls  # the busiest expert's count and the kept slots' indices, per layer


def ep_reads(rank: int, world_size: int, cases: list[tuple[str, str]]) -> list[list[str]]:
    results = []
    for impl, recompute in cases:
        model = build_model(moe_config(impl), seed=0)
        apply_expert_parallel(model, dist.group.WORLD)
        apply_recompute(model, recompute)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
        results.append(reads_in_step(model, tokens))
    return results


EP_CASES = [("grouped", "none"), ("grouped", "selective"), ("grouped", "full"), ("padded", "none")]


def test_expert_parallel_reads_the_split_sizes_once_per_layer_recompute_included() -> None:
    per_rank = run_ranks(2, ep_reads, EP_CASES)
    for calls in per_rank:
        for (impl, recompute), reads in zip(EP_CASES, calls, strict=True):
            if impl == "padded":
                assert len(reads) > LAYERS, reads  # the counter sees the padded dispatch's extra reads
            elif grouped_mm_on_cpu():
                assert reads == ["Tensor.tolist"] * LAYERS, (recompute, reads)
            else:  # the loop over the local experts reads their offsets once more per layer and recomputation
                assert reads.count("Tensor.tolist") <= LAYERS * (3 if recompute != "none" else 2), (recompute, reads)


def tp_reads(rank: int, world_size: int, cases: list[tuple[bool, float]]) -> list[list[str]]:
    from fivefold.parallel.tensor import apply_tensor_parallel

    results = []
    for sp, capacity_factor in cases:
        model = build_model(moe_config("grouped", capacity_factor), seed=0)
        apply_tensor_parallel(model, dist.group.WORLD, sp, split_experts=False)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        results.append(reads_in_step(model, tokens))
    return results


def test_whole_experts_under_tp_read_nothing_on_the_host() -> None:
    """tp2 with whole experts (each tp rank routing its half of the tokens; the statistics, capacity queues and drop
    fraction summed over tp by collectives, which read nothing): no host read, with and without SP and capacity."""
    if not grouped_mm_on_cpu():
        pytest.skip("torch.nn.functional.grouped_mm does not run on this PyTorch's CPU")
    cases = [(sp, capacity_factor) for sp in (False, True) for capacity_factor in (0.0, 1.0)]
    for calls in run_ranks(2, tp_reads, cases):
        assert calls == [[]] * len(cases), calls
