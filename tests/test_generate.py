"""A trained checkpoint exported as a complete Hugging Face directory: transformers loads the model and the
tokenizer, and its greedy `generate` equals `fivefold generate` token for token; the key/value cache."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.config import ModelConfig, build_config
from fivefold.data import prepare_dataset
from fivefold.models.generate import generate
from fivefold.models.llama import build_model
from fivefold.train.loop import train

CORPUS = Path(__file__).resolve().parents[1] / "src" / "fivefold" / "data" / "corpus"
PROMPT = "KING HENRY:\nWhat"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A few steps of a small model on a 512-token BPE slice of the built-in corpus."""
    root = tmp_path_factory.mktemp("gen")
    (root / "plays.txt").write_text(gzip.open(next(CORPUS.glob("*.txt.gz")), "rt").read()[:100_000])
    data = prepare_dataset([root / "plays.txt"], root / "data", vocab_size=512, val_fraction=0.1)
    overrides = {
        "model.n_layers": "2", "model.hidden": "64", "model.n_heads": "4", "model.n_kv_heads": "2",
        "model.ffn": "128", "model.vocab_size": "512", "model.max_seq_len": "128", "train.seq_len": "32",
        "train.global_batch_size": "8", "train.max_steps": "20", "train.warmup_steps": "2", "train.lr": "1e-2",
        "train.eval_every": "0", "train.eval_batches": "1", "log.progress": "none", "data.path": str(data),
        "run_dir": str(root / "run"),
    }
    train(build_config(None, overrides))
    return root / "run"


def test_export_is_a_complete_hf_directory_and_greedy_matches_transformers(trained_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(trained_run), "--hf", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json"} <= names
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos

    prompt_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    hf_out = model.generate(prompt_ids, max_new_tokens=40, do_sample=False, pad_token_id=eos)
    hf_new = hf_out[0, prompt_ids.shape[1]:].tolist()
    text = tokenizer.decode(hf_out[0], skip_special_tokens=True)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)  # generate produces text

    # fivefold's own model and KV cache on the checkpoint, through the CLI: the same text
    capsys.readouterr()
    for source in (["--checkpoint", str(trained_run)], ["--hf", str(out)]):
        assert main(["generate", *source, "--prompt", PROMPT, "--max-new-tokens", "40", "--temperature", "0"]) == 0
        assert capsys.readouterr().out.endswith(text + "\n")

    # token for token, on the exported weights
    from fivefold.models.hf import model_from_hf

    ours = generate(model_from_hf(out).eval(), prompt_ids[0].tolist(), 40, temperature=0.0, eos_id=eos)
    assert ours == hf_new and len(ours) > 0


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_matches_transformers_on_varied_output(tmp_path, moe):
    """A few steps of training greedy-decode into repeated newlines; random weights of a larger scale give varied
    tokens, so that a divergence anywhere in the cache or the positions would show."""
    transformers = pytest.importorskip("transformers")
    from fivefold.models.hf import export_hf

    cfg = ModelConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=96, vocab_size=97, max_seq_len=128,
                      init_std=0.2, tied_embeddings=not moe, n_experts=4 if moe else 0)
    model = build_model(cfg, seed=1).eval()
    export_hf(model, cfg, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    prompt = [5, 17, 3, 88, 42]
    hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    ours = generate(model, prompt, 60, temperature=0.0)
    assert ours == hf_out[0, len(prompt):].tolist() and len(set(ours)) > 5


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_kv_cache_logits_equal_full_forward(moe):
    cfg = ModelConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=96, vocab_size=97, max_seq_len=64,
                      n_experts=4 if moe else 0)
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
    cache = model.new_cache()
    pieces = [model.forward_cached(tokens[:, :7], cache)]  # a prompt, then one token at a time and a chunk
    pieces += [model.forward_cached(tokens[:, i:i + 1], cache) for i in range(7, 12)]
    pieces.append(model.forward_cached(tokens[:, 12:], cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_top_p_sampling_keeps_to_the_nucleus():
    from fivefold.models.generate import sample_next

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, 1.0, 0.7, g)) for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.7: tokens 2 and 3 are never drawn
    assert int(sample_next(logits, 0.0, 0.7, g)) == 0


def test_generate_cli_errors(trained_run, capsys):
    assert main(["generate", "--checkpoint", str(trained_run), "--top-p", "1.5"]) == 2
    assert "--top-p = 1.5 must be in (0, 1]" in capsys.readouterr().err
