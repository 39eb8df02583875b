"""Document masking (`model.attn_mask = "document"`) against the independent reference: each document run alone
through the plain causal model.

A packed batch is cut from a stream of random documents, each ended by EOS, in windows of seq_len + 1 tokens
that ignore document boundaries (as the sampler cuts them). The reference splits every row at its EOS tokens and
at the window's edges, runs each piece alone from position 0 with plain causal attention, and sums the cross-
entropy of its trained targets (the prediction from an EOS token is not trained). The engine under each layout
must give the same summed loss (1e-5 relative) and the same full parameter gradients (1e-5 relative to the
largest gradient of each tensor) in fp32, and the same per-token losses: the single-process model gives them
directly (1e-5); an engine gives its summed loss over SUBSETS random halves of the targets (its evaluation pass,
each 1e-5 relative of the same half of the reference's per-token losses), so a token whose loss differs is in
some half with chance 1 - 2^-SUBSETS.

Fast: one process (plain, selective and full recompute), tp2 + SP, cp2 (zig-zag). Slow (`pytest -m slow`): ep2 on
the MoE model (dp2 x ep2 on 2 ranks), pp2 under every schedule (1F1B, interleaved, AFAB, zero-bubble with full
recompute, DualPipeV), cp2 with selective recompute on the MoE model, cp2 x tp2 + SP.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from tests.distributed import run_ranks

from fivefold.config import Config, ConfigError, build_config
from fivefold.models.llama import build_model
from fivefold.models.masking import document_positions, mask_document_targets

EOS = 1
SEQ, ROWS = 32, 4
MOE = {"model.n_experts": "4", "model.top_k": "2", "model.aux_loss_coef": "0"}  # the aux loss couples documents
SUBSETS = 12


def target_halves(shape: torch.Size) -> list[torch.Tensor]:
    """SUBSETS random boolean masks, each choosing about half of the targets."""
    g = torch.Generator().manual_seed(11)
    return [torch.rand(shape, generator=g) < 0.5 for _ in range(SUBSETS)]


def doc_config(overrides: dict[str, str]) -> Config:
    base = {
        "model.n_layers": "4", "model.hidden": "64", "model.n_heads": "4", "model.n_kv_heads": "2",
        "model.ffn": "128", "model.vocab_size": "64", "model.attn_mask": "document", "train.seq_len": str(SEQ),
        "train.global_batch_size": str(ROWS), "train.dtype": "fp32", "train.device": "cpu",
        "layout.micro_batch_size": "1",
    }
    cfg = build_config(None, {**base, **overrides})
    cfg.validate()
    return cfg


def packed_batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [ROWS, SEQ] cut from a stream of documents of 1 to 20 tokens, each followed by EOS."""
    g = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    while len(stream) < ROWS * (SEQ + 1):
        n = int(torch.randint(1, 21, (1,), generator=g))
        stream += torch.randint(2, 64, (n,), generator=g).tolist() + [EOS]
    windows = torch.tensor(stream[:ROWS * (SEQ + 1)]).view(ROWS, SEQ + 1)
    return windows[:, :-1], windows[:, 1:]


def pieces(inputs: torch.Tensor, eos: int = EOS) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every document piece: each row cut after every EOS (found directly in the tokens)."""
    out = []
    for row, tokens in enumerate(inputs.tolist()):
        start = 0
        for i, token in enumerate(tokens):
            if token == eos or i == len(tokens) - 1:
                out.append((row, start, i + 1))
                start = i + 1
    return out


def reference(cfg: Config, inputs: torch.Tensor, targets: torch.Tensor, eos: int = EOS) -> tuple[
    torch.Tensor, int, dict
]:
    """Each document piece alone through the plain causal model: (per-token losses [ROWS, SEQ] with 0 where not
    trained, trained count, gradients of the summed loss / count by plain name)."""
    plain = build_model(dataclasses.replace(cfg.model, attn_mask="causal"), "cpu", cfg.train.seed)
    losses = torch.zeros(inputs.shape)
    trained = targets.clone()
    trained[inputs == eos] = -100
    count = int((trained != -100).sum())
    for row, start, stop in pieces(inputs, eos):
        logits = plain(inputs[row:row + 1, start:stop])[0]
        piece = F.cross_entropy(logits, trained[row, start:stop], reduction="none", ignore_index=-100)
        losses[row, start:stop] = piece.detach()
        (piece.sum() / count).backward()
    grads = {name: p.grad.clone() for name, p in plain.named_parameters()}
    return losses, count, grads


def engine_loss_and_grads(engine, cfg: Config, inputs: torch.Tensor, targets: torch.Tensor
                          ) -> tuple[float, dict, list[float]]:
    """This engine's summed loss (over all ranks), full gradients (plain names) and summed losses over
    `target_halves` on the packed batch: the gradients are copied into the parameters and gathered as the model
    state (after the evaluation passes, which read the weights)."""
    from fivefold.parallel.data import local_part
    from fivefold.train.loop import evaluate

    engine.eos_id = EOS
    rows = inputs.shape[0] // engine.dp_size
    lo = engine.dp_rank * rows
    targets = mask_document_targets(inputs, targets, EOS)
    count = int((targets != -100).sum())  # of the global batch, as `BatchSampler.trained_targets` counts
    halves = [evaluate(engine, [(inputs, targets.masked_fill(~half, -100))], cfg.micro_batch_size)
              * int((targets.masked_fill(~half, -100) != -100).sum()) for half in target_halves(targets.shape)]
    inputs, targets = inputs[lo:lo + rows], targets[lo:lo + rows]
    mbs = cfg.micro_batch_size
    micro = list(zip(inputs.split(mbs), targets.split(mbs), strict=True))
    loss_sum = engine.reduce_for_logging(engine.forward_backward(micro, count)).item()
    for dp in engine.data_parallels:
        dp.attach_grads()
    with torch.no_grad():
        for dp in engine.data_parallels:
            for p in dp.optimizer_params():
                local_part(p).copy_(local_part(p.grad))
    return loss_sum, engine.model_state(), halves


def layouts_on_ranks(rank: int, world_size: int, layouts: list[dict[str, str]]) -> list:
    from fivefold.train.build import build_engine

    inputs, targets = packed_batch()
    results = []
    for overrides in layouts:
        cfg = doc_config(overrides)
        results.append(engine_loss_and_grads(build_engine(cfg, torch.device("cpu")), cfg, inputs, targets))
    return results if rank == 0 else None


def assert_matches_documents(overrides: dict[str, str], loss_sum: float, grads: dict, halves: list[float]) -> None:
    cfg = doc_config({k: v for k, v in overrides.items() if not k.startswith("layout.")})
    inputs, targets = packed_batch()
    losses, count, ref = reference(cfg, inputs, targets)
    label = " ".join(f"{k}={v}" for k, v in overrides.items()) or "one process"
    assert abs(loss_sum - losses.sum().item()) <= 1e-5 * losses.sum().item(), f"{label}: {loss_sum} vs {losses.sum()}"
    for i, (got, half) in enumerate(zip(halves, target_halves(targets.shape), strict=True)):
        want = losses[half].sum().item()
        assert abs(got - want) <= 1e-5 * want, f"{label}: the loss over random half {i} is {got}, alone {want}"
    for name, want in ref.items():
        if name == "lm_head.weight" and cfg.model.tied_embeddings:
            continue
        error = (grads[name] - want).abs().max().item() / want.abs().max().item()
        assert error <= 1e-5, f"{label}: gradient of {name} differs by {error:.2e} (relative to its largest)"


def test_document_positions_restart_after_each_eos_and_at_the_window():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 4, 4, 4, EOS, 2, 3, 4]])
    assert document_positions(tokens, EOS).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 0, 1, 2]]


def test_packed_documents_match_each_document_alone_on_one_process():
    """Per-token losses and gradients of the model itself (no engine), then the one-process engine."""
    cfg = doc_config({})
    inputs, targets = packed_batch()
    ref_losses, count, ref_grads = reference(cfg, inputs, targets)
    model = build_model(cfg.model, "cpu", cfg.train.seed)
    trained = mask_document_targets(inputs, targets, EOS)
    logits = model(inputs, document_positions(inputs, EOS))
    losses = F.cross_entropy(logits.flatten(0, 1), trained.flatten(), reduction="none", ignore_index=-100)
    torch.testing.assert_close(losses.view(ROWS, SEQ).detach(), ref_losses, atol=1e-5, rtol=1e-5)
    assert count < inputs.numel() and (trained == -100).sum() == (inputs == EOS).sum()
    (losses.sum() / count).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5 * ref_grads[name].abs().max().item(), rtol=0)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_engine_with_recompute_matches_each_document_alone(recompute):
    from fivefold.train.build import build_engine

    cfg = doc_config({"layout.recompute": recompute})
    inputs, targets = packed_batch()
    assert_matches_documents({}, *engine_loss_and_grads(build_engine(cfg, torch.device("cpu")), cfg, inputs, targets))


def test_causal_mask_differs_from_documents():
    """The reference can fail: the causal model on the same packed batch gives another loss."""
    cfg = doc_config({"model.attn_mask": "causal"})
    inputs, targets = packed_batch()
    ref_losses, _, _ = reference(cfg, inputs, targets)
    model = build_model(cfg.model, "cpu", cfg.train.seed)
    trained = mask_document_targets(inputs, targets, EOS)
    losses = F.cross_entropy(model(inputs).flatten(0, 1), trained.flatten(), reduction="none", ignore_index=-100)
    assert (losses.view(ROWS, SEQ) - ref_losses).abs().max() > 1e-2


LAYOUTS_FAST = [{"layout.tp": "2", "layout.sp": "true"}, {"layout.cp": "2"}]


def test_tensor_and_context_parallel_match_each_document_alone():
    for overrides, result in zip(LAYOUTS_FAST, run_ranks(2, layouts_on_ranks, LAYOUTS_FAST)[0], strict=True):
        assert_matches_documents(overrides, *result)


ROUTER_LOSSES = {"model.n_experts": "4", "model.top_k": "2", "model.aux_loss_coef": "0.5",
                 "model.router_z_loss_coef": "0.1", "layout.micro_batch_size": "1"}


def test_pipelined_moe_router_losses_under_document_masking_match_one_process():
    """The router losses couple the documents of a micro-batch, so the reference is one process on the same
    micro-batches: their weight in the step's loss is the micro-batch's share of the global batch's tokens (every
    token is routed), not of the trained targets, on the pipeline's stages as on one process."""
    from fivefold.train.build import build_engine

    (loss_sum, grads, halves), = run_ranks(2, layouts_on_ranks, [{**ROUTER_LOSSES, "layout.pp": "2"}])[0]
    cfg = doc_config(ROUTER_LOSSES)
    want_sum, want, want_halves = engine_loss_and_grads(build_engine(cfg, torch.device("cpu")), cfg, *packed_batch())
    assert abs(loss_sum - want_sum) <= 1e-5 * want_sum
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(halves, want_halves, strict=True))
    for name, w in want.items():
        error = (grads[name] - w).abs().max().item() / w.abs().max().item()
        assert error <= 1e-5, f"gradient of {name} differs by {error:.2e} (relative to its largest)"
    assert want["layers.0.mlp.router.weight"].abs().max() > 0


LAYOUTS_SLOW = [
    {"layout.dp": "2", "layout.ep": "2", **MOE},
    {"layout.pp": "2", "layout.micro_batch_size": "1"},
    {"layout.pp": "2", "layout.schedule": "interleaved", "layout.vpp": "2"},
    {"layout.pp": "2", "layout.schedule": "afab"},
    {"layout.pp": "2", "layout.schedule": "zero-bubble", "layout.recompute": "full"},
    {"layout.pp": "2", "layout.schedule": "dualpipev"},
    {"layout.cp": "2", "layout.recompute": "selective", **MOE},
]


@pytest.mark.slow
def test_pipeline_expert_and_context_layouts_match_each_document_alone():
    for overrides, result in zip(LAYOUTS_SLOW, run_ranks(2, layouts_on_ranks, LAYOUTS_SLOW, timeout=900)[0],
                                 strict=True):
        assert_matches_documents(overrides, *result)


@pytest.mark.slow
def test_context_times_tensor_parallel_matches_each_document_alone():
    layouts = [{"layout.cp": "2", "layout.tp": "2", "layout.sp": "true"}]
    result, = run_ranks(4, layouts_on_ranks, layouts, timeout=900)[0]
    assert_matches_documents(layouts[0], *result)


@pytest.mark.parametrize("overrides, field", [
    ({"model.sliding_window": "-1"}, "model.sliding_window = -1"),
    ({"model.sliding_window": "0"}, "model.sliding_window = 0 must be >= 1"),
    ({"model.sliding_window": "wide"}, "model.sliding_window = 'wide' is not an integer"),
    ({"model.sliding_window": "33"}, "model.sliding_window = 33 exceeds train.seq_len = 32"),
    ({"model.attn_mask": "packed"}, "model.attn_mask"),
    ({"model.sliding_window": "8", "layout.cp": "2", "layout.dp": "1"}, "layout.cp = 2"),
    ({"train.compile": "true"}, "train.compile = true"),
])
def test_bad_settings_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        doc_config(overrides)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_work_sums_to_the_documents_pairs_and_skips_unshared_chunks(cp):
    """Closed form: over all cp ranks the ring computes sum(len (len + 1) / 2) pairs of the documents (each pair
    once), the causal ring seq (seq + 1) / 2 per row; a batch of one-token documents costs one pair per token."""
    from fivefold.parallel.context import ring_work

    inputs, _ = packed_batch()
    positions = document_positions(inputs, EOS)
    lengths = [stop - start for _, start, stop in pieces(inputs)]
    assert sum(ring_work(positions, cp)) == sum(n * (n + 1) // 2 for n in lengths)
    assert sum(ring_work(positions, cp, causal=True)) == ROWS * SEQ * (SEQ + 1) // 2
    singles = torch.full((2, SEQ), EOS)
    assert ring_work(document_positions(singles, EOS), cp) == [2 * SEQ // cp] * cp
