"""Float8 training (`train.float8`, torchao's Float8Linear) on the CPU, where PyTorch runs float8 matmuls with its
reference kernels.

References. One process without float8 (the working dtype, fp32 here): float8 losses stay within 2 % of it and
differ from it (float8 really ran). One process with the same recipe and the same micro-batches: a dp or pp layout
computes the same float8 products on the same rows, so it matches to the equivalence tolerances of
test_parallel_equivalence (1e-5 on losses; measured 9e-8 at most); ZeRO-3 with the tensorwise recipe gathers the
weights in float8, with the scale of the whole weight (an all-reduced amax), so it matches as well (9e-8). Under
tp2 + sp the row-parallel linears' rows are scaled over the rank's half of the features (not all of them), and under
cp2 the weight gradient's scales span the rank's half of the tokens, so their rounding differs: measured 1.3e-4 and
3.8e-5 relative on the losses, checked to 1e-3, while a misplaced shard or a lost reduction moves the loss by far
more. The layouts train at lr 2e-3: at the equivalence tests' 1e-2 the float8 model's third step is a loss spike
that turns a 1e-7 difference of the first step (an AdamW sign flip of a near-zero gradient) into 1e-3. (The
tensorwise recipe under tp2 differs more, 6.6e-3 at lr 1e-2: each rank scales its shard of the weight with its own
amax; it is not checked here.)
"""

from __future__ import annotations

import pytest
import torch
from tests.distributed import run_ranks
from tests.test_parallel_equivalence import STEPS, tiny_config, train_steps
from torch import nn

from fivefold.config import ConfigError, build_config
from fivefold.parallel.float8 import FLOAT8_LINEARS, device_problem, torchao_missing

pytest.importorskip("torchao", reason="float8 needs torchao: pip install -e '.[test]'")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def one_process(overrides: dict[str, str], micro_batch_size: int) -> list[float]:
    """Losses (each step's, then the evaluation's) of the config's model, options and micro-batches on one
    process, through the same build path as any run."""
    from fivefold.train.build import build_engine

    cfg = tiny_config({k: v for k, v in overrides.items() if not k.startswith("layout.")})
    cfg.layout.micro_batch_size = micro_batch_size
    return train_steps(build_engine(cfg, torch.device("cpu")), cfg)[0]


def test_float8_converts_the_blocks_linears_and_keeps_every_parameter():
    from fivefold.train.build import build_engine

    for recipe in ("rowwise", "tensorwise"):
        cfg = tiny_config({"train.float8": recipe, "model.n_experts": "4", "model.top_k": "2",
                           "model.n_shared_experts": "1", "model.moe_ffn": "64"})
        engine = build_engine(cfg, torch.device("cpu"))
        plain = build_engine(tiny_config({"model.n_experts": "4", "model.top_k": "2", "model.n_shared_experts": "1",
                                          "model.moe_ffn": "64"}), torch.device("cpu"))
        model = engine.model
        float8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        # attention's four and the shared expert's three per block; not the router, the output layer, the experts
        want = {f"layers.{i}.attn.{p}" for i in range(cfg.model.n_layers) for p in FLOAT8_LINEARS[:4]}
        want |= {f"layers.{i}.mlp.shared.{p}" for i in range(cfg.model.n_layers) for p in FLOAT8_LINEARS[4:]}
        assert float8 == want, recipe
        assert type(model.lm_head) is nn.Linear and type(model.layers["0"].mlp.router) is nn.Linear
        names = dict(model.named_parameters())
        plain_names = dict(plain.model.named_parameters())
        assert names.keys() == plain_names.keys()
        for name, p in names.items():  # same values from the same seed: checkpoints do not see float8
            assert torch.equal(p.detach(), plain_names[name].detach()), name


def test_float8_trains_within_two_percent_of_the_working_dtype():
    plain = one_process({}, 2)
    for recipe in ("rowwise", "tensorwise"):
        got = one_process({"train.float8": recipe}, 2)
        assert max(abs(a - b) / b for a, b in zip(got, plain, strict=True)) < 0.02, (recipe, got, plain)
        assert any(abs(a - b) > 1e-5 for a, b in zip(got, plain, strict=True)), f"{recipe}: float8 changed nothing"


def test_selective_recompute_keeps_the_float8_matmuls():
    """Selective recompute keeps `_scaled_mm`'s outputs like the other matmuls': the losses equal those without
    recompute, and the backward runs no float8 matmul of the forward again (3 per linear: output, input gradient,
    weight gradient)."""
    from torch.profiler import ProfilerActivity, profile

    from fivefold.train.build import build_engine

    counts, losses = {}, {}
    for mode in ("none", "selective"):
        cfg = tiny_config({"train.float8": "rowwise", "layout.recompute": mode})
        cfg.layout.micro_batch_size = 2
        engine = build_engine(cfg, torch.device("cpu"))
        inputs, targets = train_batches(cfg)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = engine.forward_backward([(inputs, targets)], inputs.numel())
        counts[mode] = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
        losses[mode] = loss.item()
    linears = cfg.model.n_layers * len(FLOAT8_LINEARS)
    assert counts["none"] == 3 * linears
    assert counts["selective"] == counts["none"], counts
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-6)


def train_batches(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _float8_layouts(rank: int, world_size: int, layouts: list[dict[str, str]]) -> list:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from fivefold.train.build import build_engine

    out = []
    for overrides in layouts:
        cfg = tiny_config(overrides)
        engine = build_engine(cfg, torch.device("cpu"))
        kinds = {type(m) for m in engine.model.modules()}
        assert Float8Linear in kinds
        float8_shards = [p._local_tensor for p in engine.model.parameters()
                         if isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor)]
        losses = train_steps(engine, cfg)[0]
        # after each step the next gathers' scales were computed in one all-reduce (torchao's precompute)
        assert all(getattr(w, "_precomputed_scale", None) is not None for w in float8_shards)
        out.append((losses, cfg.micro_batch_size, bool(float8_shards)))
    return out


def test_float8_layouts_match_one_process_with_float8():
    lr = {"train.lr": "2e-3"}
    layouts = [{**lr, "train.float8": "rowwise", "layout.dp": "2", "layout.zero": "1"},
               {**lr, "train.float8": "tensorwise", "layout.dp": "2", "layout.zero": "3"},
               {**lr, "train.float8": "rowwise", "layout.tp": "2", "layout.sp": "true"},
               {**lr, "train.float8": "rowwise", "layout.cp": "2"},
               {**lr, "train.float8": "rowwise", "layout.pp": "2", "layout.schedule": "dualpipev",
                "layout.micro_batch_size": "2", "model.n_layers": "4"}]
    results = run_ranks(2, _float8_layouts, layouts)[0]
    for overrides, (losses, mbs, gathers_float8) in zip(layouts, results, strict=True):
        ref = one_process(overrides, mbs)
        tol = 1e-3 if "layout.tp" in overrides or "layout.cp" in overrides else 1e-5
        assert len(losses) == STEPS + 1
        for step, (a, b) in enumerate(zip(losses, ref, strict=True)):
            assert abs(a - b) <= tol * b, f"{overrides}: loss {step + 1}: {a} vs one process {b}"
        # the float8 all-gather of ZeRO-3 runs with the tensorwise recipe only
        assert gathers_float8 == (overrides.get("layout.zero") == "3"), overrides


@pytest.mark.slow
def test_float8_all_gather_on_four_ranks_matches_one_process():
    """The float8 all-gather (tensorwise, ZeRO-3) under pp2 (each stage's units), HSDP (shard groups of 2) and
    dp2 x tp2 + sp: measured 9e-8, 9e-8 and 1.5e-4 relative on the losses."""
    lr = {"train.lr": "2e-3", "train.float8": "tensorwise", "layout.zero": "3"}
    layouts = [{**lr, "layout.dp": "2", "layout.pp": "2"}, {**lr, "layout.dp": "4", "layout.dp_shard": "2"},
               {**lr, "layout.dp": "2", "layout.tp": "2", "layout.sp": "true"}]
    for overrides, (losses, mbs, gathers_float8) in zip(layouts, run_ranks(4, _float8_layouts, layouts)[0],
                                                         strict=True):
        ref = one_process(overrides, mbs)
        tol = 1e-3 if "layout.tp" in overrides else 1e-5
        assert gathers_float8 and all(abs(a - b) <= tol * b for a, b in zip(losses, ref, strict=True)), overrides


def test_float8_bad_input_names_the_field(monkeypatch):
    with pytest.raises(ConfigError, match=r"train\.float8 = 'rowwise'.*model\.n_kv_heads x model\.head_dim / "
                                          r"layout\.tp = 24 is not"):
        build_config(None, {"model.hidden": "96", "model.n_heads": "4", "model.n_kv_heads": "1",
                            "train.float8": "rowwise"}).validate()
    with pytest.raises(ConfigError, match=r"train\.float8"):
        build_config(None, {"train.float8": "fp8"})
    with pytest.raises(ConfigError, match=r"layout\.tp_comm_overlap = true with train\.float8 = 'tensorwise'"):
        build_config(None, {"layout.tp": "2", "layout.sp": "true", "layout.tp_comm_overlap": "true",
                            "train.float8": "tensorwise"}).validate()
    # a Hopper runs both; an Ada tensorwise only (and says so); an Ampere neither; a device with no capability none
    assert device_problem("rowwise", "cuda", (9, 0)) is None
    assert device_problem("rowwise", "cpu", None) is None
    ada = device_problem("rowwise", "cuda", (8, 9))
    assert "train.float8 = 'rowwise'" in ada and "9.0" in ada and "8.9" in ada and "'tensorwise'" in ada
    assert device_problem("tensorwise", "cuda", (8, 9)) is None
    ampere = device_problem("tensorwise", "cuda", (8, 0))
    assert "8.0" in ampere and "train.float8 = 'off'" in ampere
    assert "no float8 matmul is known on xpu" in device_problem("rowwise", "xpu", None)
    # torchao absent: the extra to install
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert "pip install 'fivefold[float8]'" in torchao_missing("tensorwise")
