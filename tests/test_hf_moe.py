"""Today's MoE families through `--hf`: tiny random Qwen3-MoE, OLMoE and Qwen2-MoE (biased q/k/v, a shared expert with
its sigmoid gate) models made with `transformers` import with the same logits (1e-4) and greedy generation token for
token; fivefold's models with per-head or whole-projection query/key norms, or with q/k/v biases and a gated shared
expert, export as those architectures and load back unchanged; the features of those configs that fivefold's model
lacks are refused naming the feature. (Mixtral: tests/test_hf.py.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tests.test_hf import ATOL, VOCAB, ff_logits, hf_logits, load_transformers, random_model, small_config, tokens

from fivefold.config import ConfigError
from fivefold.models.generate import generate
from fivefold.models.hf import export_hf, load_hf, model_config_from_hf, model_from_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_experts_per_tok=2, rms_norm_eps=1e-5, max_position_embeddings=128)
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", lambda **kw: transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=40, num_experts=4, norm_topk_prob=True, **kw)),
    # Qwen3-30B-A3B's heads: 4 x 32 = 128 query and output width against hidden 64 (model.head_size)
    "qwen3-moe-wide-heads": ("Qwen3MoeForCausalLM", lambda **kw: transformers.Qwen3MoeConfig(
        **{**SHAPE, "head_dim": 32}, intermediate_size=96, moe_intermediate_size=40, num_experts=4,
        norm_topk_prob=True, **kw)),
    "qwen3-moe-unnormalised": ("Qwen3MoeForCausalLM", lambda **kw: transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=40, num_experts=4, norm_topk_prob=False, **kw)),
    "olmoe": ("OlmoeForCausalLM", lambda **kw: transformers.OlmoeConfig(
        **{k: v for k, v in SHAPE.items() if k != "head_dim"}, intermediate_size=40, num_experts=4, **kw)),
    "qwen2-moe": ("Qwen2MoeForCausalLM", lambda **kw: transformers.Qwen2MoeConfig(
        **{k: v for k, v in SHAPE.items() if k != "head_dim"}, intermediate_size=96, moe_intermediate_size=40,
        shared_expert_intermediate_size=80, num_experts=4, **kw)),
}
QK_NORMS = {"olmoe": "full", "qwen2-moe": "none"}  # the others: "head"


def transformers_model(family: str, seed: int = 7) -> torch.nn.Module:
    """A tiny random model of `family` whose every weight (norms included) is random, so a misplaced one shows."""
    cls_name, make_config = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(make_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_model_imports_with_equal_logits_and_greedy_tokens(tmp_path: Path, family: str) -> None:
    hf_model = transformers_model(family)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    model = model_from_hf(tmp_path / "hf").eval()
    assert model.cfg.qk_norm == QK_NORMS.get(family, "head")
    assert model.cfg.head_size == (32 if family == "qwen3-moe-wide-heads" else None)
    if family == "qwen2-moe":  # one shared expert twice the routed experts' width, gated; biased q, k, v
        assert model.cfg.n_shared_experts == 2 and model.cfg.shared_expert_gate and model.cfg.qkv_bias
    toks = tokens(seed=8)
    diff = (ff_logits(model, toks) - hf_logits(hf_model, toks)).abs().max().item()
    assert diff < ATOL, f"{family}: max |logit diff| vs transformers = {diff}"
    prompt = [5, 17, 3, 88, 42]
    hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    ours = generate(model, prompt, 40, temperature=0.0)
    assert ours == hf_out[0, len(prompt):].tolist() and len(set(ours)) > 5


QWEN2 = {"qkv_bias": True, "n_shared_experts": 2, "shared_expert_gate": True}
EXPORTS = [({"qk_norm": "head"}, "Qwen3MoeForCausalLM"), ({"qk_norm": "head", "head_size": 32}, "Qwen3MoeForCausalLM"),
           ({"qk_norm": "full"}, "OlmoeForCausalLM"), (QWEN2, "Qwen2MoeForCausalLM")]


@pytest.mark.parametrize(("shape", "cls_name"), EXPORTS, ids=[f"{c}-{len(s)}" for s, c in EXPORTS])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_export_matches_transformers_and_round_trips(tmp_path: Path, shape: dict, cls_name: str,
                                                     norm_topk: bool) -> None:
    cfg = small_config(n_experts=4, top_k=2, moe_ffn=48, tied_embeddings=False, norm_topk=norm_topk, **shape)
    model = random_model(cfg)
    out = export_hf(model, cfg, tmp_path / "hf")
    toks = tokens(seed=1)
    hf_model = load_transformers(out, cls_name)
    assert type(hf_model).__name__ == cls_name
    diff = (hf_logits(hf_model, toks) - ff_logits(model, toks)).abs().max().item()
    assert diff < ATOL, f"{cls_name}: max |logit diff| vs transformers = {diff}"
    cfg_back, sd_back = load_hf(out)
    assert dataclasses.replace(cfg_back, name=cfg.name, ffn=cfg.ffn, moe_ffn=cfg.moe_ffn) == cfg
    assert cfg_back.expert_ffn == cfg.expert_ffn
    assert all(torch.equal(sd_back[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("family", "change", "feature"), [
    ("qwen3-moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3-moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3-moe", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3-moe", {"attention_bias": True}, "attention_bias"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ("qwen3-moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("qwen2-moe", {"shared_expert_intermediate_size": 60}, "shared_expert_intermediate_size"),
    ("qwen2-moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
])
def test_unsupported_features_are_refused_naming_them(family: str, change: dict, feature: str) -> None:
    hf = {**FAMILIES[family][1]().to_dict(), "architectures": [FAMILIES[family][0]], **change}
    with pytest.raises(ConfigError, match=feature) as error:
        model_config_from_hf(hf)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("change", "field"), [
    ({"router_scores": "sigmoid"}, "router_scores"), ({"bias_update_rate": 0.01}, "bias_update_rate"),
    ({"norm_topk": False}, "norm_topk"), ({"n_experts": 0, "qk_norm": "full"}, "qk_norm"),
    ({"n_experts": 0, "qk_norm": "head", "qkv_bias": True}, "qkv_bias"),
    ({"n_shared_experts": 1}, "n_shared_experts"),
    ({**QWEN2, "qk_norm": "head"}, "qk_norm"),
])
def test_models_no_family_holds_refuse_export(tmp_path: Path, change: dict, field: str) -> None:
    cfg = small_config(**{"n_experts": 4, "top_k": 2, "tied_embeddings": False, **change})
    with pytest.raises(ConfigError, match=field):
        export_hf(random_model(cfg), cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
