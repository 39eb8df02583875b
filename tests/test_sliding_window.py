"""Sliding-window attention (`model.sliding_window`) against `transformers`' Mistral: a tiny random
MistralForCausalLM whose window is shorter than the sequence, imported as a Hugging Face directory, gives the same
logits (1e-4) on whole sequences and, with document masking, on a packed batch (each document against Mistral
run on it alone); greedy generation through fivefold's key/value cache equals Mistral's `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fivefold.models.generate import generate
from fivefold.models.hf import export_hf, model_config_from_hf, model_from_hf
from fivefold.models.masking import document_positions

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW, EOS = 97, 6, 2


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A random Mistral (norms random too) saved as a Hugging Face directory."""
    hf_cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=WINDOW, tie_word_embeddings=False,
    )
    torch.manual_seed(4)
    model = transformers.MistralForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("mistral") / "hf"
    model.save_pretrained(str(path))
    hf_model = transformers.MistralForCausalLM.from_pretrained(str(path), attn_implementation="eager").float().eval()
    return hf_model, path


def test_mistral_imports_with_its_window_and_equal_logits(mistral):
    hf_model, path = mistral
    model = model_from_hf(path).eval()
    assert model.cfg.sliding_window == WINDOW
    toks = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(toks), hf_model(toks).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    without = model_from_hf(path).eval()
    without.cfg.sliding_window = None
    for block in without.layers.values():
        block.attn.window = None
    with torch.no_grad():  # the window matters on this sequence: without it the logits differ
        assert (without(toks) - theirs).abs().max().item() > 1e-2


def test_window_with_document_masking_equals_mistral_on_each_document(mistral):
    hf_model, path = mistral
    model = model_from_hf(path).eval()
    model.cfg.attn_mask = "document"
    g = torch.Generator().manual_seed(2)
    docs = [torch.cat([torch.randint(3, VOCAB, (n,), generator=g), torch.tensor([EOS])]) for n in (3, 14, 9, 11)]
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        ours = model(packed, document_positions(packed, EOS))[0]
        theirs = torch.cat([hf_model(d[None]).logits[0] for d in docs])
    assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_generation_equals_mistral(mistral):
    hf_model, path = mistral
    prompt = [5, 17, 3, 88, 42, 7, 61, 30, 12]
    hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    ours = generate(model_from_hf(path).eval(), prompt, 40, temperature=0.0)
    assert ours == hf_out[0, len(prompt):].tolist() and len(set(ours)) > 5


def test_export_of_a_windowed_model_is_mistral(tmp_path):
    from fivefold.models.llama import build_model

    model = build_model(model_config_from_hf({**transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW).to_dict(), "architectures": ["MistralForCausalLM"]},
        name="w"), seed=0).eval()
    export_hf(model, model.cfg, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert type(hf_model).__name__ == "MistralForCausalLM" and hf_model.config.sliding_window == WINDOW
    toks = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(toks) - hf_model.float()(toks).logits).abs().max().item() < 1e-4
