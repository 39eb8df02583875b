"""Qwen2 (dense, biased query/key/value projections) and Qwen3 (dense, per-head query/key norms) through `--hf`: tiny
random models made with `transformers`, Qwen2 with a sliding window in every layer and without one (a released config's
`sliding_window` with `use_sliding_window = false`), Qwen3 with heads wider than hidden / heads (`model.head_size`),
import with the same logits (1e-4) and greedy generation token for token; dense models with q/k/v biases or per-head
norms export as Qwen2 or Qwen3 and load back unchanged; a window in only some layers is refused naming it."""

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

WINDOW = 6


def qwen2_config(**changes) -> object:
    return transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    rms_norm_eps=1e-5, tie_word_embeddings=False, **changes)


# with a window in every layer (max_window_layers = 0), and as released models are: a window size that is not used
VARIANTS = {"windowed": (dict(use_sliding_window=True, max_window_layers=0, sliding_window=WINDOW), WINDOW),
            "unwindowed": (dict(use_sliding_window=False, sliding_window=4096, max_window_layers=3), None)}


def qwen3_config(**changes) -> object:
    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    **changes)


@pytest.mark.parametrize("variant", [*VARIANTS, "qwen3"])
def test_qwen_dense_imports_with_equal_logits_and_greedy_tokens(tmp_path: Path, variant: str) -> None:
    changes, window = VARIANTS.get(variant, ({}, None))
    torch.manual_seed(5)
    cls_name = "Qwen3ForCausalLM" if variant == "qwen3" else "Qwen2ForCausalLM"
    config = qwen3_config() if variant == "qwen3" else qwen2_config(**changes)
    hf_model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():  # norms and biases random too, so a misplaced one shows
            p.add_(0.1 * torch.randn_like(p))
    hf_model.save_pretrained(str(tmp_path / "hf"))
    hf_model = load_transformers(tmp_path / "hf", cls_name)
    model = model_from_hf(tmp_path / "hf").eval()
    assert model.cfg.sliding_window == window
    if variant == "qwen3":
        assert model.cfg.qk_norm == "head" and model.cfg.head_size == 32 and not model.cfg.qkv_bias
    else:
        assert model.cfg.qkv_bias and model.cfg.qk_norm == "none"
    toks = tokens(seed=3)
    diff = (ff_logits(model, toks) - hf_logits(hf_model, toks)).abs().max().item()
    assert diff < ATOL, f"{variant}: max |logit diff| vs transformers = {diff}"
    prompt = [5, 17, 3, 88, 42, 7, 61, 30, 12]
    hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    ours = generate(model, prompt, 30, temperature=0.0)
    assert ours == hf_out[0, len(prompt):].tolist() and len(set(ours)) > 5


DENSE_EXPORTS = {"qwen2": ({"qkv_bias": True}, "Qwen2ForCausalLM"),
                 "qwen2-window": ({"qkv_bias": True, "sliding_window": WINDOW}, "Qwen2ForCausalLM"),
                 "qwen3-wide-heads": ({"qk_norm": "head", "head_size": 32}, "Qwen3ForCausalLM"),
                 "qwen3-window": ({"qk_norm": "head", "sliding_window": WINDOW}, "Qwen3ForCausalLM")}


@pytest.mark.parametrize("case", list(DENSE_EXPORTS))
def test_dense_models_with_biases_or_head_norms_export_as_qwen(tmp_path: Path, case: str) -> None:
    changes, cls_name = DENSE_EXPORTS[case]
    cfg = small_config(tied_embeddings=False, **changes)
    model = random_model(cfg)
    out = export_hf(model, cfg, tmp_path / "hf")
    hf_model = load_transformers(out, cls_name)
    assert type(hf_model).__name__ == cls_name
    toks = tokens(seed=1)
    diff = (hf_logits(hf_model, toks) - ff_logits(model, toks)).abs().max().item()
    assert diff < ATOL, f"max |logit diff| vs transformers = {diff}"
    cfg_back, sd_back = load_hf(out)
    assert dataclasses.replace(cfg_back, name=cfg.name) == cfg
    assert all(torch.equal(sd_back[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("changes", [
    dict(use_sliding_window=True, max_window_layers=1, sliding_window=WINDOW),  # layers 1 and 2 of 3 slide
    dict(layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=WINDOW),
])
def test_a_window_in_some_layers_is_refused_naming_it(changes: dict) -> None:
    hf = {**qwen2_config().to_dict(), "architectures": ["Qwen2ForCausalLM"], **changes}
    if "layer_types" not in changes:
        hf.pop("layer_types", None)  # as transformers 4 wrote it: the layers follow from max_window_layers
    with pytest.raises(ConfigError, match="layer_types") as error:
        model_config_from_hf(hf)
    assert "\n" not in str(error.value)
