"""The MoE routing choices against per-token references written out here: softmax or sigmoid scores, with or without
top-k normalisation; the Switch and sequence-wise load-balancing losses and the router z-loss by their published
formulas; auxiliary-loss-free balancing (DeepSeek-V3): the bias chooses the experts but does not weigh them, the loads
of a step are counted once per training forward (not again by recompute, not by evaluation), and an optimizer step
moves the bias by the rate towards the mean load; bad routing settings refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError, ModelConfig
from fivefold.models.llama import MoE, build_model
from fivefold.parallel.recompute import apply_recompute


def moe_config(**changes) -> ModelConfig:
    base = dict(n_layers=2, hidden=32, ffn=48, n_heads=4, n_kv_heads=2, vocab_size=64, n_experts=4, top_k=2)
    return ModelConfig(**{**base, **changes})


def moe_layer(**changes) -> MoE:
    torch.manual_seed(0)
    moe = MoE(moe_config(**changes))
    moe.reset_parameters()
    torch.nn.init.normal_(moe.router.weight, std=0.3)
    return moe


def reference_output(moe: MoE, x: torch.Tensor, sigmoid: bool, normalise: bool, bias: torch.Tensor) -> torch.Tensor:
    """Per token: scores, the top-k of scores + bias, weights = the chosen scores (over their sum if normalised)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = moe.router.weight @ x[t]
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
        chosen = sorted(range(moe.n_experts), key=lambda e: -float(scores[e] + bias[e]))[:moe.top_k]
        total = sum(scores[e] for e in chosen) if normalise else 1.0
        for e in chosen:
            h = F.silu(x[t] @ moe.w_gate[e]) * (x[t] @ moe.w_up[e])
            out[t] += scores[e] / total * (h @ moe.w_down[e])
    return out


@pytest.mark.parametrize("scores", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("biased", [False, True])
def test_scores_normalisation_and_bias_equal_the_per_token_reference(scores: str, norm_topk: bool,
                                                                      biased: bool) -> None:
    moe = moe_layer(router_scores=scores, norm_topk=norm_topk, bias_update_rate=0.01 if biased else 0.0)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0])
    if biased:  # large enough to change the choice of most tokens: expert 3 is always chosen
        bias = torch.tensor([0.0, 0.0, 0.0, 2.0])
        moe.expert_bias.copy_(bias)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = moe(x)
        experts, _ = moe.route(x)
        expected = reference_output(moe, x, scores == "sigmoid", norm_topk, bias)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if biased:
        assert (experts == 3).any(-1).all()


def test_sequence_wise_loss_is_deepseek_v3s_formula() -> None:
    moe = moe_layer(aux_loss="sequence", router_scores="sigmoid")
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        moe(x)
    n, k, seq = moe.n_experts, moe.top_k, x.shape[1]
    losses = []
    for row in x:  # L = sum_i f_i P_i, f_i = N / (K T) * #tokens choosing i, P_i = mean of s_i / sum_j s_j
        scores = torch.sigmoid(row @ moe.router.weight.t())
        chosen = scores.topk(k, -1).indices
        f = torch.tensor([float((chosen == i).sum()) for i in range(n)]) * n / (k * seq)
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        losses.append(float((f * p).sum()))
    assert moe.aux_loss.item() == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # the Switch loss of the same routing pools the three sequences: another number
    switch = moe_layer(aux_loss="switch", router_scores="sigmoid")
    with torch.no_grad():
        switch(x)
    assert abs(switch.aux_loss.item() - moe.aux_loss.item()) > 1e-4


def test_router_loss_weighs_the_z_loss_and_the_balancing_loss() -> None:
    cfg = moe_config(router_z_loss_coef=0.003, aux_loss_coef=0.02)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    inputs = {}
    for name, block in model.layers.items():
        block.mlp.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0]))
    with torch.no_grad():
        model(tokens)
    z = sum(torch.logsumexp(inputs[n].reshape(-1, 32) @ b.mlp.router.weight.t(), -1).square().mean()
            for n, b in model.layers.items())
    expected = 0.003 * z + 0.02 * model.moe_aux_loss()
    assert model.moe_router_loss().item() == pytest.approx(expected.item(), rel=1e-6)


def routed_loads(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The expert loads of a forward of `model`, counted from each layer's input by top-k of scores + bias."""
    loads, handles = {}, []
    for name, block in model.layers.items():
        def count(m, args, name=name):
            if name not in loads:  # the original forward, not a recomputation
                x = args[0].reshape(-1, args[0].shape[-1])
                chosen = (torch.softmax(m.router(x), -1) + m.expert_bias).topk(m.top_k, -1).indices
                loads[name] = torch.bincount(chosen.reshape(-1), minlength=m.n_experts)
        handles.append(block.mlp.register_forward_pre_hook(count))
    with torch.no_grad():
        model(tokens)
    for h in handles:
        h.remove()
    return loads


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_loads_are_counted_once_per_training_forward_and_the_bias_moves_by_the_rate(recompute: str) -> None:
    from tests.test_parallel_equivalence import tiny_config

    from fivefold.train.build import single_device_engine

    rate = 0.05
    cfg = tiny_config({"model.n_experts": "4", "model.top_k": "2", "model.bias_update_rate": str(rate),
                       "layout.recompute": recompute})
    engine = single_device_engine(build_model(cfg.model, "cpu", 0), cfg, torch.device("cpu"))
    if recompute != "none":
        apply_recompute(engine.model, recompute)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 17), generator=torch.Generator().manual_seed(4))
    moes = {n: b.mlp for n, b in engine.model.layers.items()}
    expected_bias = {n: torch.zeros(4) for n in moes}
    for _ in range(3):
        expected = routed_loads(engine.model, tokens[:, :-1])
        engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], tokens[:, 1:].numel())
        with torch.no_grad():  # an evaluation forward counts nothing
            engine.model(tokens[:, :-1])
        for n, moe in moes.items():
            assert torch.equal(moe.expert_load, expected[n]), (n, moe.expert_load, expected[n])
        engine.optimizer_step()
        for n, moe in moes.items():
            load = expected[n].float()
            expected_bias[n] += rate * torch.sign(load.mean() - load)
            torch.testing.assert_close(moe.expert_bias, expected_bias[n])
            assert not moe.expert_load.any()
    assert any(b.abs().sum() > 0 for b in expected_bias.values())


def test_the_bias_of_the_equivalence_tests_changes_the_run() -> None:
    from tests.test_parallel_equivalence import BIASED, MOE, reference_run

    plain, biased = reference_run(MOE)[0], reference_run(BIASED)[0]
    assert plain[0] == biased[0]  # the first step routes with a zero bias
    assert abs(plain[-1] - biased[-1]) > 1e-5 * abs(plain[-1])  # later, the bias has changed the routing


@pytest.mark.parametrize(("changes", "field"), [
    ({"bias_update_rate": -0.001}, "model.bias_update_rate"),
    ({"router_scores": "tanh"}, "model.router_scores"),
    ({"aux_loss": "global"}, "model.aux_loss"),
    ({"router_z_loss_coef": -1.0}, "model.router_z_loss_coef"),
    ({"moe_impl": "dense"}, "model.moe_impl"),
    ({"top_k": 5}, "model.top_k"),
])
def test_bad_routing_settings_are_refused_naming_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as error:
        moe_config(**changes).validate()
    assert "\n" not in str(error.value)


def test_a_resumed_run_keeps_the_balancing_bias_bit_for_bit(tmp_path) -> None:
    """Save after step 1 and load into a fresh engine: the same losses and biases as without the interruption (a
    bias that restarted at zero routes differently and changes the losses)."""
    from tests.test_parallel_equivalence import BIASED, resumed_after_one_step, tiny_config

    want, got, whole, first, second = resumed_after_one_step(tiny_config(BIASED), tmp_path)
    assert sorted(first.balancing_biases()) == ["buffer.layers.0.mlp.expert_bias", "buffer.layers.1.mlp.expert_bias"]
    assert all(b.abs().sum() > 0 for b in first.balancing_biases().values())
    assert got == want
    for name, bias in whole.balancing_biases().items():
        assert torch.equal(second.balancing_biases()[name], bias), name
