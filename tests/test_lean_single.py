"""Lean mixed precision on one device (`LocalDataParallel` with masters, the one-device default under bf16): bf16
working weights, bf16 or fp32 gradients, an fp32 master copy stepped by AdamW and cast to the working weights once
per step.

References: the closed form 2 + (2 or 4) + 12 bytes per parameter, with the parameter count taken from the model's
shape; the autocast engine (`Engine`: fp32 weights cast to bf16 per matmul) on the same batches, with the
tolerances of `tests/test_parallel_equivalence.py::test_lean_bf16_data_parallel_matches_one_process_bf16` (whose
docstring derives them); and the engine itself without interruption for a checkpoint round trip (bit for bit).
"""

from __future__ import annotations

import pytest
import torch
from tests.test_parallel_equivalence import global_batches, resumed_after_one_step, tiny_config, train_steps
from tests.test_parallel_memory import params_per_tp_rank

from fivefold.models.llama import build_model
from fivefold.parallel.data import LocalDataParallel
from fivefold.train.build import Engine, build_engine, single_device_engine

BF16 = {"train.dtype": "bf16"}


def state_bytes(engine: Engine) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state (fp32 masters and moments) that the engine holds."""
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    held = [*engine.model.parameters(), *engine.data_parallel.master]
    grads = sum(t.grad.numel() * t.grad.element_size() for t in held if t.grad is not None)
    masters = sum(m.numel() * m.element_size() for m in engine.data_parallel.master)
    moments = sum(v.numel() * v.element_size() for s in engine.optimizer.state.values() for k, v in s.items()
                  if k != "step")
    return {"weights": weights, "gradients": grads, "optimizer": masters + moments}


@pytest.mark.parametrize("fp32_grads", [False, True])
def test_lean_single_device_bytes_per_parameter(fp32_grads):
    cfg = tiny_config({**BF16, "layout.fp32_grad_accum": str(fp32_grads).lower()})
    engine = build_engine(cfg, torch.device("cpu"))
    assert isinstance(engine.data_parallel, LocalDataParallel) and engine.data_parallel.master is not None
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    psi = params_per_tp_rank(cfg.model, 1)
    inputs, targets = global_batches(cfg)[0]
    micro = list(zip(inputs.split(cfg.micro_batch_size), targets.split(cfg.micro_batch_size), strict=True))
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    engine.forward_backward(micro, tokens)
    engine.optimizer_step()
    engine.forward_backward(micro, tokens)  # gradients accumulated over the micro-batches, before the step
    assert state_bytes(engine) == {"weights": 2 * psi, "gradients": (4 if fp32_grads else 2) * psi,
                                   "optimizer": 12 * psi}
    grads = [m.grad for m in engine.data_parallel.master] if fp32_grads else [p.grad for p in engine.model.parameters()]
    assert all(g is not None and g.dtype == (torch.float32 if fp32_grads else torch.bfloat16) for g in grads)


@pytest.mark.parametrize("fp32_grads", [False, True])
def test_lean_single_device_matches_autocast_engine(fp32_grads):
    """The same training as the autocast engine within bf16 noise (tolerances derived in the lean data-parallel
    test). Measured: losses 9e-6 relative before any update, then up to 3.5e-4 (checked to 5e-3); gradient norms
    up to 6.7e-3 (checked to 3e-2). With the cast back to the working weights left out, the loss after the last
    update is 6.2e-2 off: a master not stepped, not cast back or stepped on the wrong gradient fails it."""
    overrides = {**BF16, "layout.fp32_grad_accum": str(fp32_grads).lower()}
    cfg = tiny_config(overrides)
    lean = build_engine(cfg, torch.device("cpu"))
    losses, norms, _ = train_steps(lean, cfg)
    ref_cfg = tiny_config(BF16)
    ref = single_device_engine(build_model(ref_cfg.model, "cpu", ref_cfg.train.seed), ref_cfg, torch.device("cpu"))
    ref_losses, ref_norms, _ = train_steps(ref, ref_cfg)
    assert abs(losses[0] - ref_losses[0]) <= 1e-4 * abs(ref_losses[0])
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 5e-3 * abs(b), f"loss {a} vs {b}"
    for a, b in zip(norms, ref_norms, strict=True):
        assert abs(a - b) <= 3e-2 * abs(b), f"grad norm {a} vs {b}"
    state, ref_state = lean.model_state(), ref.model_state()
    assert state.keys() == ref_state.keys()
    for name, want in ref_state.items():
        assert state[name].dtype == torch.float32, f"{name} is saved from the fp32 master"
        assert ((state[name] - want).norm() / want.norm()).item() <= 0.15, name
    # the working weights are the masters cast once, after the last step
    for p, m in zip(lean.data_parallel.working, lean.data_parallel.master, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_lean_single_device_resumes_bit_for_bit(tmp_path):
    """Save the pieces after step 1 (fp32 masters and moments), load them into a fresh engine, train on: the same
    losses and masters as without the interruption."""
    want, got, whole, _, second = resumed_after_one_step(tiny_config(BF16), tmp_path)
    assert got == want
    for name, value in whole.model_state().items():
        assert torch.equal(second.model_state()[name], value), name


def test_fp32_residual_stream_option():
    """`model.fp32_residual = true` on the lean path: the stream between blocks is fp32 (and so are a pipeline's
    sends), the training the same within bf16 noise as the autocast engine's, whose stream is fp32 too."""
    from fivefold.parallel.pipeline import activation_dtype

    overrides = {**BF16, "model.fp32_residual": "true"}
    cfg = tiny_config(overrides)
    lean = build_engine(cfg, torch.device("cpu"))
    seen = []
    lean.model.layers["0"].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    losses, norms, _ = train_steps(lean, cfg)
    assert seen and set(seen) == {torch.float32}
    assert activation_dtype([lean.model], True) == torch.float32
    assert activation_dtype([build_engine(tiny_config(BF16), torch.device("cpu")).model], True) == torch.bfloat16
    ref_cfg = tiny_config(BF16)
    ref = single_device_engine(build_model(ref_cfg.model, "cpu", ref_cfg.train.seed), ref_cfg, torch.device("cpu"))
    ref_losses, ref_norms, _ = train_steps(ref, ref_cfg)
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 5e-3 * abs(b), f"loss {a} vs {b}"
    for a, b in zip(norms, ref_norms, strict=True):
        assert abs(a - b) <= 3e-2 * abs(b), f"grad norm {a} vs {b}"


def accumulated_grads(fp32_grads: bool, micro_batches: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradient the lean engine accumulates over `micro_batches` micro-batches of one sequence each (bf16
    working weights; fp32 or bf16 accumulation), and the fp64 sum of the same engine's gradient of each micro-batch
    alone (each exact in the accumulation buffer: one bf16 gradient, cast)."""
    overrides = {**BF16, "train.global_batch_size": str(micro_batches), "layout.micro_batch_size": "1"}
    cfg = tiny_config({**overrides, "layout.fp32_grad_accum": str(fp32_grads).lower()})
    inputs, targets = global_batches(cfg)[0]
    micro = list(zip(inputs.split(1), targets.split(1), strict=True))
    tokens = micro_batches * cfg.train.seq_len
    engine = build_engine(cfg, torch.device("cpu"))
    engine.forward_backward(micro, tokens)
    lean = engine.data_parallel
    got = [m.grad if fp32_grads else p.grad for p, m in zip(lean.working, lean.master, strict=True)]
    ref_cfg = tiny_config({**overrides, "layout.fp32_grad_accum": "true"})
    ref = build_engine(ref_cfg, torch.device("cpu"))
    want = [torch.zeros_like(m, dtype=torch.float64) for m in ref.data_parallel.master]
    for one in micro:
        ref.forward_backward([one], tokens)
        for w, m in zip(want, ref.data_parallel.master, strict=True):
            w.add_(m.grad.double())
            m.grad = None
    return got, want


def test_fp32_grad_accumulation_over_64_micro_batches_matches_fp64():
    """The default (`layout.fp32_grad_accum = true`) under bf16 working weights: 64 micro-batches' gradients summed
    in fp32 are within 1e-3 relative (whole-model norm) of their fp64 sum; summed in bf16 (the buffer of the working
    weights' dtype) they are not."""
    assert tiny_config(BF16).layout.fp32_grad_accum, "fp32 accumulation is the default"

    def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
        diff = sum(((g.double() - w) ** 2).sum() for g, w in zip(got, want, strict=True)).sqrt()
        return (diff / sum((w ** 2).sum() for w in want).sqrt()).item()

    fp32 = relative_error(*accumulated_grads(True, 64))
    bf16 = relative_error(*accumulated_grads(False, 64))
    print(f"relative error of the accumulated gradient: fp32 {fp32:.2e}, bf16 {bf16:.2e}")
    assert fp32 <= 1e-3
    assert bf16 > 1e-3
