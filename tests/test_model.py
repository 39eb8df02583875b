"""The plain model against independent references: closed-form and published parameter counts, the
causal property, GQA as MHA with repeated key/value heads, MoE against a per-token loop, the
Switch load-balancing formula, and Llama-3 rotary scaling against transformers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError, ModelConfig
from fivefold.flops import count_params
from fivefold.models import llama
from fivefold.models.llama import MoE, build_model, rope_frequencies
from fivefold.presets import PRESETS, get_preset
from fivefold.train.metrics import peak_resident_bytes, reset_peak_resident


def small_config(**changes) -> ModelConfig:
    base = ModelConfig(name="test", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=96, vocab_size=101,
                       max_seq_len=64)
    return dataclasses.replace(base, **changes)


# --- parameter counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count_matches_real_model_and_published_size(name: str) -> None:
    cfg, published, _ = PRESETS[name]
    model = build_model(get_preset(name), device="meta")
    real = sum(p.numel() for p in model.parameters())  # a tied weight is one Parameter, counted once
    assert count_params(cfg) == real
    if published is not None:
        assert real == published


def test_meta_build_allocates_nothing() -> None:
    reset_peak_resident()  # the peak from here: an earlier test's would hide the build's growth
    before = peak_resident_bytes()
    model = build_model(get_preset("llama-3.1-70b"), device="meta")
    grown_mib = (peak_resident_bytes() - before) / 2**20
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 70e9
    assert grown_mib < 200  # the real weights would take 280 GB in fp32


# --- attention -------------------------------------------------------------------------------------


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    cfg = small_config()
    model = build_model(cfg, seed=0).eval()
    toks = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    changed = toks.clone()
    t = 15
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(toks), model(changed)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-3)


def test_gqa_equals_mha_with_repeated_kv_weights() -> None:
    gqa_cfg = small_config(n_heads=8, n_kv_heads=2)
    mha_cfg = dataclasses.replace(gqa_cfg, n_kv_heads=8)
    gqa, mha = build_model(gqa_cfg, seed=0).eval(), build_model(mha_cfg, seed=1).eval()
    repeat, d = gqa_cfg.n_heads // gqa_cfg.n_kv_heads, gqa_cfg.head_dim
    state = {}
    for name, w in gqa.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # each kv head serves `repeat` consecutive query heads
            w = w.view(gqa_cfg.n_kv_heads, d, -1).repeat_interleave(repeat, dim=0).reshape(-1, w.shape[-1])
        state[name] = w
    mha.load_state_dict(state)
    toks = torch.randint(0, gqa_cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(gqa(toks), mha(toks), atol=1e-5, rtol=0)


# --- mixture of experts ----------------------------------------------------------------------------


# the MoE implementations: grouped (torch.nn.functional.grouped_mm where it runs), grouped by a loop over the experts
# (where it does not), padded
IMPLS = ["grouped", "loop", "padded"]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch) -> str:
    if request.param == "loop":
        monkeypatch.setattr(llama, "grouped_mm_runs", lambda *args: False)
    return "padded" if request.param == "padded" else "grouped"


def moe_layer(seed: int = 0, **changes) -> MoE:
    cfg = small_config(n_experts=4, top_k=2, moe_ffn=32, **changes)
    torch.manual_seed(seed)
    moe = MoE(cfg)
    moe.reset_parameters()
    return moe


def reference_moe(moe: MoE, x: torch.Tensor, capacity: int | None = None) -> tuple[torch.Tensor, float]:
    """Per-token loop: each token's top-k experts, renormalised weights; with `capacity`, an expert
    takes tokens in (token, slot) order until full. Returns the output and the dropped fraction."""
    probs = F.softmax(x @ moe.router.weight.t(), dim=-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    load = [0] * moe.n_experts
    dropped = 0
    for t in range(x.shape[0]):
        for slot in range(moe.top_k):
            e = int(experts[t, slot])
            if capacity is not None and load[e] >= capacity:
                dropped += 1
                continue
            load[e] += 1
            h = F.silu(x[t] @ moe.w_gate[e]) * (x[t] @ moe.w_up[e])
            out[t] += weights[t, slot] * (h @ moe.w_down[e])
    if moe.shared is not None:
        out += moe.shared(x)
    return out, dropped / (x.shape[0] * moe.top_k)


def test_moe_batched_experts_equal_per_token_loop(impl: str) -> None:
    moe = moe_layer(n_shared_experts=1, moe_impl=impl)
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = moe(x)
        expected, _ = reference_moe(moe, x.reshape(-1, 64))
    assert torch.allclose(out.reshape(-1, 64), expected, atol=1e-5, rtol=0)
    assert moe.drop_fraction.item() == 0.0


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_moe_gradients_equal_the_per_token_loop(impl: str, capacity_factor: float) -> None:
    moe = moe_layer(n_shared_experts=1, moe_impl=impl, capacity_factor=capacity_factor)
    x = skewed_inputs(moe).requires_grad_()
    capacity = math.ceil(capacity_factor * x.shape[0] * moe.top_k / moe.n_experts) if capacity_factor else None
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    grads = []
    for forward in (moe, lambda t: reference_moe(moe, t, capacity)[0]):
        moe.zero_grad()
        x.grad = None
        (forward(x) * grad_out).sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in moe.parameters())])
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def skewed_inputs(moe: MoE, tokens: int = 40) -> torch.Tensor:
    """Inputs that the router sends mostly to experts 0 and 1, so that capacity matters."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 64, generator=gen)
    x[:, 0] = 2.0
    with torch.no_grad():
        moe.router.weight[:, 0] = torch.tensor([1.0, 0.5, 0.0, -0.5])
    return x


def test_moe_dropless_drops_nothing_under_imbalance(impl: str) -> None:
    moe = moe_layer(moe_impl=impl)
    x = skewed_inputs(moe)
    with torch.no_grad():
        out = moe(x)
        expected, _ = reference_moe(moe, x)
    loads = torch.bincount(moe.route(x)[0].reshape(-1), minlength=4)
    assert loads.max() > 1.5 * x.shape[0] * moe.top_k / moe.n_experts  # really imbalanced
    assert moe.drop_fraction.item() == 0.0
    assert torch.allclose(out, expected, atol=1e-5, rtol=0)


def test_moe_capacity_routing_drops_overflow_and_reports_fraction(impl: str) -> None:
    moe = moe_layer(capacity_factor=1.0, moe_impl=impl)
    x = skewed_inputs(moe)
    capacity = math.ceil(1.0 * x.shape[0] * moe.top_k / moe.n_experts)
    with torch.no_grad():
        out = moe(x)
        expected, dropped = reference_moe(moe, x, capacity=capacity)
    assert dropped > 0.05
    assert moe.drop_fraction.item() == pytest.approx(dropped)
    assert torch.allclose(out, expected, atol=1e-5, rtol=0)


def test_moe_aux_loss_is_the_switch_formula() -> None:
    moe = moe_layer()
    x = skewed_inputs(moe, tokens=32)
    with torch.no_grad():
        moe(x)
    probs = F.softmax(x @ moe.router.weight.t(), dim=-1)
    chosen = probs.topk(moe.top_k, dim=-1).indices
    # Switch Transformer: E * sum_e f_e * P_e, f_e = share of routed (token, slot) pairs sent to e
    f = torch.tensor([(chosen == e).sum().item() for e in range(moe.n_experts)]) / chosen.numel()
    p = probs.mean(0)
    expected = moe.n_experts * sum(f[e] * p[e] for e in range(moe.n_experts))
    assert moe.aux_loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # a perfectly uniform router gives the loss's minimum, 1
    with torch.no_grad():
        moe.router.weight.zero_()
        moe(x)
    assert moe.aux_loss.item() == pytest.approx(1.0, rel=1e-6)


def test_moe_gradients_reach_every_expert_and_the_router(impl: str) -> None:
    cfg = small_config(n_experts=4, top_k=2, moe_ffn=32, n_layers=1, moe_impl=impl)
    model = build_model(cfg, seed=0)
    toks = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(4))
    loss = F.cross_entropy(model(toks).flatten(0, 1), toks.flatten()) + model.moe_aux_loss()
    loss.backward()
    moe = model.layers["0"].mlp
    for w in (moe.w_gate, moe.w_up, moe.w_down):
        assert all(w.grad[e].abs().sum() > 0 for e in range(cfg.n_experts))
    assert moe.router.weight.grad.abs().sum() > 0


# --- rotary embeddings -----------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [None, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192.0},
                                     {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                      "original_max_position_embeddings": 512.0}])
def test_rope_frequencies_equal_transformers(scaling: dict | None) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = small_config(hidden=1024, n_heads=8, n_kv_heads=8, rope_theta=500000.0, rope_scaling=scaling or {})
    if scaling is None:
        d = cfg.head_dim  # default rope: the textbook formula
        expected = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    else:
        hf_scaling = {**scaling, "rope_type": "llama3",
                      "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
        hf_cfg = transformers.LlamaConfig(hidden_size=cfg.hidden, num_attention_heads=cfg.n_heads,
                                          rope_theta=cfg.rope_theta, rope_scaling=hf_scaling,
                                          max_position_embeddings=131072)
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, device="cpu")
    assert torch.allclose(rope_frequencies(cfg), expected.float(), rtol=1e-5, atol=0)


# --- config validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("changes,field", [
    ({"hidden": 100, "n_heads": 3}, "model.n_heads"),
    ({"n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads"),
    ({"hidden": 60, "n_heads": 4}, "model.n_heads"),  # head_dim 15 is odd
    ({"n_experts": 4, "top_k": 5}, "model.top_k"),
])
def test_bad_shapes_raise_config_error_naming_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        small_config(**changes).validate()


def test_initial_values_of_any_slice_equal_the_full_tensors_slice():
    """The layout-free init: a slice drawn alone (a tp column block, an ep expert, a ZeRO-3 row chunk, rows and
    columns that straddle tiles) is exactly that slice of the whole tensor, drawing only the tiles it meets, and the
    whole model built in one process holds the whole tensors."""
    from fivefold.models.llama import (
        INIT_TILE_COLUMNS,
        draw_initial_values,
        full_parameter_shapes,
        init_tile,
        initial_values,
    )

    cfg = dataclasses.replace(get_preset("tiny"), n_experts=4, top_k=2, moe_ffn=32, n_shared_experts=1)
    model = build_model(cfg, seed=7)
    shapes = full_parameter_shapes(cfg)
    for name, param in model.named_parameters():
        full = initial_values(cfg, name, shapes[name], seed=7)
        assert torch.equal(full, param.detach()), name
    shape = (700, 3 * INIT_TILE_COLUMNS + 40)  # several tiles along both dims, partial ones at the ends
    rows, columns = init_tile(shape)
    assert rows < shape[0] and columns < shape[1]
    full = initial_values(cfg, "layers.0.attn.q_proj.weight", shape, seed=3)
    assert full.std().item() == pytest.approx(cfg.init_std, rel=0.01)
    for region in [((0, shape[0]), (32, 64)), ((rows - 3, shape[0] - 2), (0, shape[1])),
                   ((17, 18), (columns - 5, 2 * columns + 9)), ((0, shape[0]), (shape[1] // 4, shape[1] // 2))]:
        part = torch.empty([b - a for a, b in region], dtype=torch.float64)
        drawn = draw_initial_values(part, cfg, "layers.0.attn.q_proj.weight", shape, seed=3, region=region)
        assert torch.equal(part, full[region[0][0]:region[0][1], region[1][0]:region[1][1]].double()), region
        # only the tiles the region meets: they reach less than a tile beyond it on each side
        (r0, r1), (c0, c1) = region
        assert drawn <= (r1 - r0 + 2 * (rows - 1)) * (c1 - c0 + 2 * (columns - 1)), region
    # a column quarter (tensor parallel's row-parallel shard) draws about a quarter, not whole rows
    quarter = ((0, shape[0]), (0, shape[1] // 4))
    assert draw_initial_values(torch.empty(shape[0], shape[1] // 4), cfg, "layers.0.attn.q_proj.weight", shape, 3,
                               quarter) <= shape[0] * (shape[1] // 4 + columns)
    other = initial_values(cfg, "layers.1.attn.q_proj.weight", shape, seed=3)
    assert not torch.equal(other, full)  # each parameter draws its own values
