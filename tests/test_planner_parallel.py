"""The planner's activation bytes against the parallel engine: tp2 with and without sequence parallel, with
recompute none / selective / full, MoE with whole experts (etp = 1: each tp rank routes its 1/tp of the tokens) and
with experts split over tp (etp = 2), measured with `torch.autograd.graph.saved_tensors_hooks` on 2 gloo ranks
(fp32, CPU) during a real forward pass of the tensor-parallel tiny model and its vocabulary-parallel loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from fivefold.models.llama import build_model
from fivefold.planner.layout import FIVEFOLD_CPU, Layout
from fivefold.planner.memory import forward_saved_bytes
from fivefold.presets import get_preset

tensor = pytest.importorskip("fivefold.parallel.tensor")
recompute_module = pytest.importorskip("fivefold.parallel.recompute")

TOL = 0.05


def _config(preset: str):
    cfg = get_preset(preset.removesuffix("-capacity"))
    # "-capacity": the padded experts with a capacity factor (their tensors' size deterministic); else the grouped
    # default (dropless, balanced on average: each rank's routed slots are its tokens x top_k)
    return dataclasses.replace(cfg, capacity_factor=1.25, moe_impl="padded") if preset.endswith("-capacity") else cfg


def _measure_on_ranks(rank: int, world: int, cases: list[tuple]) -> list[int]:
    """Saved bytes of one forward per case (preset, batch, seq, sp, recompute, etp) on this tp rank."""
    out = []
    group = dist.group.WORLD
    for preset, batch, seq, sp, recompute, etp in cases:
        cfg = _config(preset)
        model = build_model(cfg, "cpu", seed=0)
        # the engine's default overlap (`layout.tp_comm_overlap` with sp), which changes what selective keeps
        tensor.apply_tensor_parallel(model, group, sp, split_experts=etp > 1, comm_overlap=sp)
        recompute_module.apply_recompute(model, recompute)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, params=params, seen=seen) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen.setdefault(st.data_ptr(), st.nbytes())
            return t

        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        if recompute == "selective":  # the outputs the op-level policy keeps out of autograd's sight count too
            from test_recompute import held_bytes

            exclude = params | {tokens.untyped_storage().data_ptr()}
            def run(model=model, tokens=tokens, sp=sp) -> torch.Tensor:
                return tensor.vocab_parallel_loss_sum(model, model.forward_hidden(tokens), tokens, group, sp)

            out.append(held_bytes(run, exclude)[0])
            continue
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = model.forward_hidden(tokens)
            tensor.vocab_parallel_loss_sum(model, hidden, tokens, group, sp)
        out.append(sum(seen.values()))
    return out


def _check(cases: list[tuple]) -> None:
    results = run_ranks(2, _measure_on_ranks, cases)
    for i, (preset, batch, seq, sp, recompute, etp) in enumerate(cases):
        measured = results[0][i]
        # the two tp ranks hold the same bytes; under selective recompute the count includes the checkpoint's cached
        # outputs found through `gc`, which has differed between the ranks by one or two small storages (1,024 and
        # 1,536 of 2.5 MB, sp with selective, not investigated further): equal to 0.1 %; with whole experts and a
        # capacity each rank routes its own tokens into the capacity of the whole sequence, so their index tensors
        # differ (0.5 % apart here): equal to 2 %; else equal
        rel = 1e-3 if recompute == "selective" else 0.02 if (etp == 1 and preset.endswith("-capacity")) else 0
        assert results[1][i] == pytest.approx(measured, rel=rel)
        lay = Layout(tp=2, sp=sp, recompute=recompute, etp=etp)
        predicted = forward_saved_bytes(_config(preset), batch, seq, lay, FIVEFOLD_CPU)
        assert predicted == pytest.approx(measured, rel=TOL), (preset, batch, seq, sp, recompute, etp, measured)


def test_tp2_activation_bytes():
    _check([("tiny", 2, 64, sp, rc, 1) for sp in (False, True) for rc in ("none", "selective", "full")]
           + [("tiny-moe-capacity", 2, 32, sp, "none", etp) for sp in (False, True) for etp in (1, 2)]
           + [("tiny-moe", 2, 32, sp, "none", etp) for sp in (False, True) for etp in (1, 2)])


@pytest.mark.slow
def test_tp2_activation_bytes_more_shapes():
    _check([(p, b, s, sp, rc, etp) for p in ("tiny", "tiny-moe-capacity") for b, s in ((1, 128), (3, 64), (4, 256))
            for sp in (False, True) for rc in ("none", "selective", "full")
            for etp in ((1, 2) if "moe" in p else (1,))])


# --- the whole step's peak under data parallel -----------------------------------------------------------------


def _step_peak_on_ranks(rank: int, world: int, stages: list[int]) -> list[tuple[int, int]]:
    """Per ZeRO stage: (the live tensor bytes at the peak of one training step on this dp rank, the planner's peak),
    the tiny model, fp32, micro-batch 8 of 128 tokens. The live bytes are the model states held when the step
    starts plus the highest sum of the allocations and frees the profiler records in the step (every CPU tensor
    allocation goes through the one allocator it watches)."""
    from torch.profiler import ProfilerActivity, profile

    from fivefold.config import build_config
    from fivefold.planner.hardware import get_cluster
    from fivefold.planner.predict import estimate_run
    from fivefold.train.build import build_engine

    out = []
    for zero in stages:
        cfg = build_config(None, {"model.preset": "tiny", "train.seq_len": "128", "train.dtype": "fp32",
                                  "train.device": "cpu", "layout.micro_batch_size": "8",
                                  "train.global_batch_size": "16", "layout.dp": str(world), "layout.zero": str(zero)})
        engine = build_engine(cfg, torch.device("cpu"))
        tokens = torch.randint(0, cfg.model.vocab_size, (8, 129), generator=torch.Generator().manual_seed(rank))
        batch = [(tokens[:, :-1], tokens[:, 1:])]

        def step(engine=engine, batch=batch) -> None:
            engine.forward_backward(batch, 16 * 128)
            engine.optimizer_step()

        step()
        step()  # the optimizer's moments exist from the first step on
        held = sum(engine.state_bytes().values())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        live = peak = 0
        for _, nbytes in events:
            live += nbytes
            peak = max(peak, live)
        out.append((held + peak, int(estimate_run(cfg, get_cluster("cpu"), "cpu").peak_bytes)))
    return out


def test_data_parallel_step_peak_follows_the_engine():
    """The planner's peak of a dp2 rank under ZeRO-0/1/2/3 against the live tensors of a real step: within 6 %.
    ZeRO-0/1 reduce their buckets in place (the gradients), so nothing is reserved beside them; ZeRO-2 holds at most
    three full buckets (the tiny model's one bucket, counted beside the slice though it lives only in backward);
    ZeRO-3 (fully_shard) has no buckets. A fixed reserve of two 25 MiB buckets had put these four 68-82 % over."""
    from fivefold.parallel.data import ZERO2_IN_FLIGHT
    from fivefold.planner.memory import ZERO2_FULL_BUCKETS

    assert ZERO2_FULL_BUCKETS == ZERO2_IN_FLIGHT + 1
    stages = [0, 1, 2, 3]
    for rank_results in run_ranks(2, _step_peak_on_ranks, stages):
        for zero, (measured, predicted) in zip(stages, rank_results, strict=True):
            assert predicted == pytest.approx(measured, rel=0.06), (zero, measured, predicted)
