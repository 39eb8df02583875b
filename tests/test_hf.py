"""Hugging Face interoperability, checked against `transformers` itself: a fivefold model exported to a
HF directory gives the same logits in LlamaForCausalLM / MixtralForCausalLM, and models written by
`transformers` import into fivefold with the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fivefold.cli import main as cli_main
from fivefold.config import Config, ConfigError, ModelConfig
from fivefold.models.hf import (
    CheckpointError,
    export_hf,
    from_hf_state_dict,
    hf_config_from_model_config,
    load_hf,
    model_config_from_hf,
    model_from_hf,
    to_hf_state_dict,
)
from fivefold.models.llama import Llama, build_model

transformers = pytest.importorskip("transformers")

# acceptance bound for fp32 logits of fivefold vs transformers
ATOL = 1e-4
VOCAB = 97
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16.0}


def small_config(**changes) -> ModelConfig:
    base = ModelConfig(name="test", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=96, vocab_size=VOCAB,
                       max_seq_len=64, norm_eps=1e-5)
    return dataclasses.replace(base, **changes)


SHAPES = {
    "mha-tied": small_config(n_kv_heads=4, tied_embeddings=True),
    "gqa-untied": small_config(n_kv_heads=2, tied_embeddings=False),
    "gqa-untied-llama3-rope": small_config(n_kv_heads=1, tied_embeddings=False, rope_theta=500000.0,
                                           rope_scaling=dict(SCALING)),
    "mha-tied-llama3-rope": small_config(n_kv_heads=4, tied_embeddings=True, rope_scaling=dict(SCALING)),
}


def random_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    """A model whose every weight (norms included) is random, so that any misplaced tensor shows."""
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def tokens(seed: int = 0, batch: int = 2, seq: int = 40) -> torch.Tensor:
    # seq > original_max_position_embeddings, so scaled and unscaled frequencies both matter
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_model: torch.nn.Module, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(toks).logits.float()


def ff_logits(model: torch.nn.Module, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(toks).float()


def load_transformers(path: Path, cls_name: str) -> torch.nn.Module:
    cls = getattr(transformers, cls_name)
    return cls.from_pretrained(str(path), attn_implementation="eager").float().eval()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_export_matches_transformers_and_round_trips(tmp_path: Path, shape: str) -> None:
    cfg = SHAPES[shape]
    model = random_model(cfg)
    out = export_hf(model, cfg, tmp_path / "hf")
    toks = tokens()
    expected = ff_logits(model, toks)
    hf_model = load_transformers(out, "LlamaForCausalLM")
    assert hf_model.config.tie_word_embeddings == cfg.tied_embeddings
    diff = (hf_logits(hf_model, toks) - expected).abs().max().item()
    assert diff < ATOL, f"{shape}: max |logit diff| vs transformers = {diff}"

    cfg_back, sd_back = load_hf(out)
    assert dataclasses.replace(cfg_back, name=cfg.name) == cfg
    reference = model.state_dict()
    if cfg.tied_embeddings:
        assert "lm_head.weight" not in sd_back
        reference.pop("lm_head.weight")
    assert sd_back.keys() == reference.keys()
    assert all(torch.equal(sd_back[k], reference[k]) for k in reference)
    assert torch.equal(ff_logits(model_from_hf(out), toks), expected)


def test_tied_weight_saved_once(tmp_path: Path) -> None:
    from safetensors import safe_open

    cfg = SHAPES["mha-tied"]
    out = export_hf(random_model(cfg), cfg, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("tied,scaled", [(False, True), (True, False)])
def test_transformers_model_imports_with_equal_logits(tmp_path: Path, tied: bool, scaled: bool) -> None:
    kwargs = {"rope_scaling": {"rope_type": "llama3", **SCALING}} if scaled else {}
    if scaled:
        kwargs["rope_scaling"]["original_max_position_embeddings"] = 16
    hf_cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=50000.0,
        tie_word_embeddings=tied, **kwargs,
    )
    torch.manual_seed(3)
    hf_model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF initialises norms to one; make them random too
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf_model.save_pretrained(str(tmp_path / "hf"))
    model = model_from_hf(tmp_path / "hf")
    assert model.cfg.n_kv_heads == 2 and model.cfg.tied_embeddings == tied
    assert bool(model.cfg.rope_scaling) == scaled and model.cfg.rope_theta == 50000.0
    toks = tokens(seed=5)
    diff = (ff_logits(model, toks) - hf_logits(hf_model, toks)).abs().max().item()
    assert diff < ATOL


def test_sharded_transformers_checkpoint_imports(tmp_path: Path) -> None:
    hf_cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False)
    torch.manual_seed(4)
    hf_model = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf_model.save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    toks = tokens(seed=6)
    diff = (ff_logits(model_from_hf(tmp_path / "hf"), toks) - hf_logits(hf_model, toks)).abs().max().item()
    assert diff < ATOL


def moe_config(**changes) -> ModelConfig:
    return small_config(n_experts=4, top_k=2, moe_ffn=48, tied_embeddings=False, **changes)


def test_moe_export_matches_mixtral(tmp_path: Path) -> None:
    cfg = moe_config()
    model = random_model(cfg)
    out = export_hf(model, cfg, tmp_path / "hf")
    toks = tokens(seed=1)
    expected = ff_logits(model, toks)
    diff = (hf_logits(load_transformers(out, "MixtralForCausalLM"), toks) - expected).abs().max().item()
    assert diff < ATOL
    cfg_back, sd_back = load_hf(out)
    assert cfg_back.n_experts == 4 and cfg_back.top_k == 2 and cfg_back.expert_ffn == 48
    assert all(torch.equal(sd_back[k], v) for k, v in model.state_dict().items())


def test_transformers_mixtral_imports_with_equal_logits(tmp_path: Path) -> None:
    hf_cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        max_position_embeddings=64,
    )
    torch.manual_seed(7)
    hf_model = transformers.MixtralForCausalLM(hf_cfg).eval()
    hf_model.save_pretrained(str(tmp_path / "hf"))
    model = model_from_hf(tmp_path / "hf")
    toks = tokens(seed=8)
    assert (ff_logits(model, toks) - hf_logits(hf_model, toks)).abs().max().item() < ATOL


def test_shared_experts_refuse_export(tmp_path: Path) -> None:
    cfg = moe_config(n_shared_experts=1)
    with pytest.raises(ConfigError, match="n_shared_experts"):
        export_hf(build_model(cfg, seed=0), cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# --- configs --------------------------------------------------------------------------------------


def test_config_round_trip_and_rope_keys_of_both_transformers_versions() -> None:
    cfg = SHAPES["gqa-untied-llama3-rope"]
    hf = hf_config_from_model_config(cfg)
    assert dataclasses.replace(model_config_from_hf(hf), name=cfg.name) == cfg
    # transformers 4 style (rope_theta + rope_scaling) and 5 style (rope_parameters) read the same
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    modern = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    assert model_config_from_hf(legacy) == model_config_from_hf(modern) == model_config_from_hf(hf)
    # transformers itself reads the exported dict to the same rotary settings
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    assert model_config_from_hf(hf_cfg.to_dict()) == model_config_from_hf(hf)


@pytest.mark.parametrize("change,match", [
    ({"head_dim": 31}, "head_size = 31 is odd"),
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 3}, "n_kv_heads"),
])
def test_bad_hf_configs_raise_clear_errors(change: dict, match: str) -> None:
    hf = {**hf_config_from_model_config(small_config()), **change}
    with pytest.raises(ConfigError, match=match):
        model_config_from_hf(hf)


def test_mismatched_state_dict_lists_the_differences() -> None:
    cfg = small_config(tied_embeddings=False)
    sd = build_model(cfg, seed=0).state_dict()
    sd["layers.0.attn.q_proj.weight"] = torch.zeros(3, 3)
    del sd["norm.weight"]
    with pytest.raises(CheckpointError, match=r"missing: norm\.weight.*wrong shape: layers\.0\.attn\.q_proj"):
        to_hf_state_dict(sd, cfg)
    hf_sd = to_hf_state_dict(build_model(cfg, seed=0).state_dict(), cfg)
    hf_sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"unexpected: model\.layers\.9"):
        from_hf_state_dict(hf_sd, cfg)


def test_shard_index_cannot_point_outside_the_directory(tmp_path: Path) -> None:
    cfg = small_config()
    hf_dir = export_hf(build_model(cfg, seed=0), cfg, tmp_path / "hf")
    (hf_dir / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    index = {"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file in"):
        load_hf(hf_dir)


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model_config(small_config())))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pickled"):
        load_hf(tmp_path)


# --- the `fivefold export` verb -------------------------------------------------------------------


def write_checkpoint(ckpt: Path, cfg: ModelConfig, model: Llama, complete: bool = True) -> None:
    """The trainer's checkpoint of `model` under `cfg` at `ckpt` (`Checkpointer.save`: pieces, manifest, trainer
    state, COMPLETE; the step from a `step_N` name, in its run directory), the COMPLETE marker taken away unless
    `complete`."""
    import re
    import shutil

    from fivefold.train.build import single_device_engine
    from fivefold.train.checkpoint import Checkpointer

    named = re.fullmatch(r"step_(\d+)", ckpt.name)
    run = ckpt.parent.parent if named and ckpt.parent.name == "checkpoints" else ckpt.parent / f".run-{ckpt.name}"
    config = Config(model=cfg)
    engine = single_device_engine(model, config, torch.device("cpu"))
    path = Checkpointer(run, engine, config).save(int(named[1]) if named else 1, tokens_seen=0, samples_consumed=0,
                                                  prune=False)
    assert path is not None
    if path != ckpt:
        shutil.move(path, ckpt)
        shutil.rmtree(run)
    if not complete:
        (ckpt / "COMPLETE").unlink()


def test_export_cli_picks_newest_complete_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = SHAPES["gqa-untied-llama3-rope"]
    run_dir = tmp_path / "run"
    old, new, partial = random_model(cfg, seed=1), random_model(cfg, seed=2), random_model(cfg, seed=3)
    write_checkpoint(run_dir / "checkpoints" / "step_00000010", cfg, old)
    write_checkpoint(run_dir / "checkpoints" / "step_00000020", cfg, new)
    write_checkpoint(run_dir / "checkpoints" / "step_00000030", cfg, partial, complete=False)
    out = tmp_path / "hf"
    assert cli_main(["export", "--checkpoint", str(run_dir), "--hf", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step_00000020" in printed and "step_00000030" in printed  # used, and skipped as incomplete
    toks = tokens(seed=9)
    diff = hf_logits(load_transformers(out, "LlamaForCausalLM"), toks) - ff_logits(new, toks)
    assert diff.abs().max().item() < ATOL


def test_export_cli_single_tied_checkpoint(tmp_path: Path) -> None:
    cfg = SHAPES["mha-tied"]
    model = random_model(cfg)
    write_checkpoint(tmp_path / "ckpt", cfg, model)
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    toks = tokens()
    diff = (hf_logits(load_transformers(tmp_path / "hf", "LlamaForCausalLM"), toks) - ff_logits(model, toks))
    assert diff.abs().max().item() < ATOL


def test_export_cli_moe_checkpoint(tmp_path: Path) -> None:
    cfg = moe_config()
    model = random_model(cfg)
    write_checkpoint(tmp_path / "ckpt", cfg, model)
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    toks = tokens()
    diff = hf_logits(load_transformers(tmp_path / "hf", "MixtralForCausalLM"), toks) - ff_logits(model, toks)
    assert diff.abs().max().item() < ATOL


def test_export_cli_corrupt_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = small_config()
    write_checkpoint(tmp_path / "ckpt", cfg, build_model(cfg, seed=0))
    weights = tmp_path / "ckpt" / "rank0.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


def test_export_and_generate_verify_a_sharded_checkpoints_checksums(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """A checkpoint as the trainer writes it (pieces, manifest of sha256s): exported as is; with bytes changed in the
    middle of its piece file, `export` and `generate` refuse it naming the file, and nothing is written."""
    import torch

    from fivefold.train.build import single_device_engine
    from fivefold.train.checkpoint import Checkpointer

    cfg = small_config()
    config = Config(model=cfg)
    engine = single_device_engine(build_model(cfg, seed=0), config, torch.device("cpu"))
    path = Checkpointer(tmp_path / "run", engine, config).save(1, tokens_seen=0, samples_consumed=0)
    assert cli_main(["export", "--checkpoint", str(path), "--hf", str(tmp_path / "hf")]) == 0
    toks = tokens()
    diff = hf_logits(load_transformers(tmp_path / "hf", "LlamaForCausalLM"), toks) - ff_logits(engine.model, toks)
    assert diff.abs().max().item() < ATOL
    piece = path / "rank0.safetensors"
    data = bytearray(piece.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    piece.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_main(["export", "--checkpoint", str(path), "--hf", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert f"{piece} is corrupted: its sha256" in err, err
    assert not (tmp_path / "hf2").exists()
    assert cli_main(["generate", "--checkpoint", str(path), "--max-new-tokens", "2"]) == 2
    assert f"{piece} is corrupted" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")], ids=["nan", "inf"])
def test_export_and_generate_refuse_non_finite_weights_as_a_resume_does(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                        bad: float) -> None:
    """A checkpoint whose manifest vouches for a piece file holding one NaN or infinity (written so, not damaged on
    the way): a resume refuses it (the reference), and so do `export` and `generate`, in one line naming the tensor;
    given the run directory, export takes the older finite checkpoint and says why it skipped the newer one."""
    from safetensors.torch import load_file, save_file

    from fivefold.train.build import single_device_engine
    from fivefold.train.checkpoint import Checkpointer, CheckpointError, load_checkpoint, write_manifest

    cfg = small_config()
    run = tmp_path / "run"
    good, poisoned = run / "checkpoints" / "step_00000010", run / "checkpoints" / "step_00000020"
    write_checkpoint(good, cfg, random_model(cfg, seed=1))
    write_checkpoint(poisoned, cfg, random_model(cfg, seed=2))
    name = "model.layers.1.mlp.down_proj.weight"
    piece = json.loads((poisoned / "index.json").read_text())["tensors"][name]["pieces"][0]
    tensors = load_file(str(poisoned / piece["file"]))
    tensors[piece["key"]][3, 5] = bad
    save_file(tensors, str(poisoned / piece["file"]))
    write_manifest(poisoned)  # the manifest vouches for the file as it now is
    engine = single_device_engine(build_model(cfg, seed=0), Config(model=cfg), torch.device("cpu"))
    with pytest.raises(CheckpointError, match="holds NaN or inf"):
        Checkpointer(run, engine, Config(model=cfg)).load([poisoned])
    load_checkpoint(poisoned)  # every file passes the manifest: only the values are wrong
    capsys.readouterr()
    assert cli_main(["export", "--checkpoint", str(poisoned), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds NaN or inf in tensor '{name}'" in err, err
    assert not (tmp_path / "hf").exists()
    assert cli_main(["generate", "--checkpoint", str(poisoned), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"holds NaN or inf in tensor '{name}'" in err, err
    assert cli_main(["export", "--checkpoint", str(run), "--hf", str(tmp_path / "from_run")]) == 0
    out = capsys.readouterr().out
    assert "using step_00000010" in out and "skipped the newer step_00000020 (" in out and name in out, out
    assert cli_main(["export", "--checkpoint", str(good), "--hf", str(tmp_path / "named")]) == 0
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("from_run", "named"))
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)


def test_export_cli_mismatched_shapes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = small_config()
    write_checkpoint(tmp_path / "ckpt", cfg, build_model(dataclasses.replace(cfg, ffn=128), seed=0))
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "wrong shape" in err and "layers.0.mlp.gate_proj.weight: [128, 64] (expected [96, 64])" in err
    assert not (tmp_path / "hf").exists()


def test_export_cli_no_complete_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = small_config()
    write_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000005", cfg, build_model(cfg, seed=0),
                     complete=False)
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert cli_main(["export", "--checkpoint", str(tmp_path / "nowhere"), "--hf", str(tmp_path / "hf")]) == 2


def test_export_cli_refuses_non_empty_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = small_config()
    write_checkpoint(tmp_path / "ckpt", cfg, build_model(cfg, seed=0))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("user file")
    args = ["export", "--checkpoint", str(tmp_path / "ckpt"), "--hf", str(out)]
    assert cli_main(args) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "user file"
    # --overwrite writes the model and keeps the other files
    assert cli_main([*args, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not list(tmp_path.glob(".hf.tmp-*"))


def test_models_verb_lists_every_preset(capsys: pytest.CaptureFixture) -> None:
    from fivefold.flops import count_params
    from fivefold.presets import PRESETS

    assert cli_main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(PRESETS)
    for row in rows:
        assert row["params"] == count_params(PRESETS[row["name"]][0])
    assert cli_main(["models"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in PRESETS) and "1.236B" in table


def test_models_lists_every_alias_it_accepts(capsys):
    """Every other name `get_preset` accepts is listed by `fivefold models` (text and --json) under the preset it
    builds, and builds that preset's shape; a name that is neither is refused with the aliases listed."""
    from fivefold.presets import ALIASES, PRESETS, get_preset

    assert cli_main(["models", "--json"]) == 0
    listed = {alias: r["name"] for r in json.loads(capsys.readouterr().out) for alias in r["aliases"]}
    assert listed == ALIASES and len(listed) == 12
    for alias, name in listed.items():
        assert alias not in PRESETS
        assert dataclasses.asdict(get_preset(alias)) == dataclasses.asdict(PRESETS[name][0])
    assert cli_main(["models"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("aliases"))
    for name in set(listed.values()):
        assert f"{', '.join(a for a, n in listed.items() if n == name)} = {name}" in line
    with pytest.raises(ConfigError, match="or an alias: llama3.2-1b"):
        get_preset("llama-9")


def test_export_streams_one_tensor_at_a_time_into_shards(tmp_path: Path) -> None:
    """`write_hf_dir` asks for one tensor (or one expert) at a time and has let go of the previous one by then; with a
    small shard size the files, each within the size (a larger tensor alone), and their index load in
    `transformers` with the model's logits, and an --overwrite export as one file removes the earlier shards."""
    import gc
    import weakref

    from fivefold.models.hf import expected_hf_shapes, write_hf_dir

    cfg = moe_config()
    model = random_model(cfg)
    sd = model.state_dict()
    alive: list[weakref.ref] = []

    def read(name: str, expert: int | None) -> torch.Tensor:
        gc.collect()
        assert all(ref() is None for ref in alive), "an earlier tensor is still held"
        value = (sd[name] if expert is None else sd[name][expert]).clone()
        alive.append(weakref.ref(value))
        return value

    limit = 40_000
    out = write_hf_dir(read, lambda name: sd[name].dtype, cfg, tmp_path / "hf", max_shard_bytes=limit)
    assert len(alive) == len(expected_hf_shapes(cfg))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    sizes = {k: torch.Size(v).numel() * 4 for k, v in expected_hf_shapes(cfg).items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for name in files:
        held = [k for k, f in index["weight_map"].items() if f == name]
        assert sum(sizes[k] for k in held) <= limit or len(held) == 1, name
    toks = tokens(seed=2)
    diff = hf_logits(load_transformers(out, "MixtralForCausalLM"), toks) - ff_logits(model, toks)
    assert diff.abs().max().item() < ATOL
    export_hf(model, cfg, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_export_cli_refuses_a_bad_shard_size(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = small_config()
    write_checkpoint(tmp_path / "ckpt", cfg, build_model(cfg, seed=0))
    for bad in ("0", "nan", "-1"):
        try:  # nan is refused by the flag's type (argparse exits 2), the others by the range check (returns 2)
            rc = cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf"),
                           "--max-shard-gb", bad])
        except SystemExit as e:
            rc = e.code
        assert rc == 2
        assert "--max-shard-gb" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
