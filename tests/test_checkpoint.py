"""Checkpoint writing is atomic, loading needs no unpickling and refuses what does not match."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from fivefold.config import Config, dump_toml
from fivefold.models.llama import build_model
from fivefold.train import checkpoint as ckpt
from fivefold.train.optim import build_adamw


def _trained_state(seed: int):
    cfg = Config()
    model = build_model(cfg.model, seed=seed)
    opt = build_adamw(model, cfg.train, torch.device("cpu"))
    model(torch.randint(0, cfg.model.vocab_size, (2, 8))).sum().backward()
    opt.step()
    return cfg, model, opt


def _save(run_dir, step, model, opt, cfg):
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return ckpt.save_checkpoint(run_dir, ckpt.TrainerState(step=step, tokens_seen=step * 10), state,
                                opt.state_dict(), dump_toml(cfg), torch.device("cpu"))


def test_round_trip_exact(tmp_path):
    cfg, model, opt = _trained_state(0)
    path = _save(tmp_path, 5, model, opt, cfg)
    loaded = ckpt.load_checkpoint(path)
    assert loaded.state.step == 5 and loaded.state.tokens_seen == 50
    for k, v in model.state_dict().items():
        if k != "lm_head.weight":
            assert torch.equal(loaded.model_state[k], v)
    want = opt.state_dict()
    assert loaded.optimizer_state["param_groups"] == want["param_groups"]
    for idx, per in want["state"].items():
        for name, value in per.items():
            assert torch.equal(loaded.optimizer_state["state"][idx][name], value)
    # the loaded state drives a fresh optimizer
    fresh = build_adamw(build_model(cfg.model, seed=1), cfg.train, torch.device("cpu"))
    fresh.load_state_dict(loaded.optimizer_state)


def test_interrupted_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    cfg, model, opt = _trained_state(0)
    first = _save(tmp_path, 1, model, opt, cfg)
    calls = {"n": 0}
    real_save = ckpt.save_file

    def dying_save(tensors, filename, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the model file is written, the writer dies on the optimizer file
            with open(filename, "wb") as f:
                f.write(b"\x00" * 17)
            raise KeyboardInterrupt("killed")
        return real_save(tensors, filename, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model, opt, cfg)
    monkeypatch.setattr(ckpt, "save_file", real_save)
    assert ckpt.latest_checkpoint(tmp_path) == first  # the half-written step 2 is not a checkpoint
    assert (tmp_path / "checkpoints" / "step_00000002.tmp").exists()
    ckpt.load_checkpoint(first)
    # the next writer cleans up the leftover and writes step 2 properly
    second = _save(tmp_path, 2, model, opt, cfg)
    assert ckpt.latest_checkpoint(tmp_path) == second
    assert not (tmp_path / "checkpoints" / "step_00000002.tmp").exists()


def test_never_overwrites(tmp_path):
    cfg, model, opt = _trained_state(0)
    path = _save(tmp_path, 3, model, opt, cfg)
    before = (path / "model.safetensors").read_bytes()
    with pytest.raises(ckpt.CheckpointError, match="already exists"):
        _save(tmp_path, 3, model, opt, cfg)
    assert (path / "model.safetensors").read_bytes() == before


def test_corrupted_and_mismatched(tmp_path):
    cfg, model, opt = _trained_state(0)
    path = _save(tmp_path, 4, model, opt, cfg)
    (path / "optimizer.safetensors").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="optimizer.safetensors is corrupted"):
        ckpt.load_checkpoint(path)
    other = Config()
    other.model.hidden = 64
    expected = {k: v for k, v in build_model(other.model).state_dict().items() if k != "lm_head.weight"}
    loaded = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ckpt.CheckpointError, match=r"embed\.weight: checkpoint \(2048, 128\) vs model \(2048, 64\)"):
        ckpt.check_model_state(loaded, expected, path)
    (path / "COMPLETE").unlink()
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(path)


def test_pickles_are_never_loaded(tmp_path):
    """A checkpoint file holding a pickle (as torch.save writes) is refused, not executed."""
    cfg, model, opt = _trained_state(0)
    path = _save(tmp_path, 6, model, opt, cfg)
    torch.save({"x": torch.zeros(1)}, path / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupted"):
        ckpt.load_checkpoint(path)
    ckpt.write_manifest(path)  # even with matching checksums the pickle is refused, not unpickled
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupted"):
        ckpt.load_checkpoint(path)
    save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))  # valid file, wrong names
    ckpt.write_manifest(path)
    loaded = ckpt.load_checkpoint(path)
    with pytest.raises(ckpt.CheckpointError, match="missing embed.weight"):
        ckpt.check_model_state(loaded.model_state, dict(model.state_dict()), path)
