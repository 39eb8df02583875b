"""The training loop end to end on CPU: resume exactness, metrics, run-directory and data errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from fivefold.cli import main
from fivefold.config import ConfigError, build_config
from fivefold.data import prepare_dataset
from fivefold.train.checkpoint import CheckpointError, latest_checkpoint, read_model_state
from fivefold.train.loop import RunDirError, train

CORPUS = Path(__file__).resolve().parents[1] / "src" / "fivefold" / "data" / "corpus"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small prepared dataset: a slice of the built-in corpus with a 512-token BPE vocabulary."""
    import gzip

    root = tmp_path_factory.mktemp("data")
    text = gzip.open(next(CORPUS.glob("*.txt.gz")), "rt").read()[:200_000]
    (root / "plays.txt").write_text(text)
    out = root / "prepared"
    prepare_dataset([root / "plays.txt"], out, vocab_size=512, val_fraction=0.1)
    return out


def small_config(run_dir: Path, data: Path, **extra: str):
    overrides = {
        "model.n_layers": "2", "model.hidden": "64", "model.n_heads": "4", "model.n_kv_heads": "2",
        "model.ffn": "128", "model.vocab_size": "512", "train.seq_len": "32", "train.global_batch_size": "8",
        "layout.micro_batch_size": "4", "train.max_steps": "6", "train.warmup_steps": "2",
        "train.checkpoint_every": "3", "train.eval_every": "0", "train.eval_batches": "2", "log.log_every": "1",
        "log.progress": "none", "data.path": str(data), "run_dir": str(run_dir), **extra,
    }
    return build_config(None, overrides)


@pytest.mark.parametrize("preset_overrides", [{}, {"model.n_experts": "4", "model.top_k": "2"}],
                         ids=["dense", "moe"])
def test_resume_reproduces_uninterrupted_run_exactly(tmp_path, dataset, preset_overrides):
    full = train(small_config(tmp_path / "full", dataset, **preset_overrides))
    first = train(small_config(tmp_path / "cut", dataset, **preset_overrides), stop_after=3)
    assert first.steps == 3 and latest_checkpoint(tmp_path / "cut").name == "step_00000003"
    rest = train(small_config(tmp_path / "cut", dataset, **preset_overrides), resume=True)
    assert full.losses == first.losses + rest.losses  # bit for bit
    assert full.val_losses[6] == rest.val_losses[6]
    a = read_model_state(latest_checkpoint(tmp_path / "full"))
    b = read_model_state(latest_checkpoint(tmp_path / "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the resumed run's log has each step once
    steps = [r["step"] for r in map(json.loads, (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_metrics_records(tmp_path, dataset):
    cfg = small_config(tmp_path / "run", dataset, **{"log.peak_tflops": "0.25", "train.max_steps": "2"})
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in vals] == [0, 2]
    keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
            "mfu", "peak_memory_bytes"}
    for r in steps:
        assert set(r) == keys
        assert r["tokens_per_s"] == r["tokens_per_s_per_device"] > 0
        assert math.isclose(r["mfu"], r["tflops_per_device"] / 0.25)
        assert r["peak_memory_bytes"] > 0 and r["grad_norm"] > 0
    # step 0 validation is the untrained model's loss: close to ln(vocab) for a fresh model
    assert abs(vals[0]["val_loss"] - math.log(512)) < 0.5
    assert (tmp_path / "run" / "config.toml").is_file()
    assert build_config(tmp_path / "run" / "config.toml").to_dict() == cfg.to_dict()


def test_cpu_mfu_is_of_the_planners_cpu_peak_everywhere(tmp_path, dataset, capsys):
    """One rule for MFU on a CPU: against the planner's built-in cpu profile (what `plan` and `sweep` divide by),
    in `train`'s step records and summary as in `bench` (`resolve_peak_tflops`), said in the summary."""
    from fivefold.planner.hardware import get_cluster
    from fivefold.planner.layout import FIVEFOLD_CPU, Layout
    from fivefold.planner.search import estimate
    from fivefold.train.metrics import resolve_peak_tflops

    cpu = get_cluster("cpu")
    for dtype in ("fp32", "bf16"):
        assert resolve_peak_tflops(0.0, torch.device("cpu"), dtype) * 1e12 == cpu.peak_flops(dtype)
    cfg = small_config(tmp_path / "run", dataset, **{"train.max_steps": "2", "log.progress": "plain"})
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps and all(math.isclose(r["mfu"], r["tflops_per_device"] * 1e12 / cpu.peak_flops("fp32"))
                         for r in steps)
    summary = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("summary:"))
    assert "MFU n/a" not in summary and "% of the nominal CPU peak (the planner's cpu profile" in summary
    # the planner's MFU on the same profile: its tokens/s over the same peak
    e = estimate(cfg.model, cfg.train.seq_len, Layout(micro_batch_size=cfg.micro_batch_size,
                                                      grad_accum_steps=cfg.grad_accum_steps), FIVEFOLD_CPU, cpu)
    flops = e.mfu * cpu.peak_flops("fp32") / e.tokens_per_s_per_device
    assert math.isclose(steps[0]["tflops_per_device"] * 1e12 / steps[0]["tokens_per_s_per_device"], flops)


def test_existing_run_is_never_overwritten(tmp_path, dataset):
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "1"}))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(RunDirError, match="already holds another run"):
        train(small_config(run, dataset, **{"train.max_steps": "1"}))
    with pytest.raises(RunDirError, match="not before train.max_steps = 1"):
        train(small_config(run, dataset, **{"train.max_steps": "1"}), resume=True)
    with pytest.raises(RunDirError, match="holds no complete checkpoint"):
        train(small_config(tmp_path / "empty", dataset), resume=True)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_resume_with_another_model_is_refused(tmp_path, dataset):
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "1"}))
    with pytest.raises(CheckpointError, match=r"does not match the configured model: .*checkpoint \(512, 64\) vs"):
        train(small_config(run, dataset, **{"train.max_steps": "2", "model.hidden": "128"}), resume=True)
    # a corrupted checkpoint is named
    ckpt_dir = latest_checkpoint(run)
    (ckpt_dir / "rank0.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="rank0.safetensors is corrupted"):
        train(small_config(run, dataset, **{"train.max_steps": "2"}), resume=True)


def test_bad_data_inputs(tmp_path, dataset):
    with pytest.raises(ConfigError, match="data.path = .*nope.* is not a directory"):
        train(small_config(tmp_path / "r1", tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"model.vocab_size 256 is smaller than .*set model.vocab_size >= 512"):
        train(small_config(tmp_path / "r2", dataset, **{"model.vocab_size": "256"}))
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_cli_errors_are_one_line(tmp_path, dataset, capsys):
    assert main(["train", "--data", str(dataset), "--run-dir", str(tmp_path / "r"), "--model.n_heads", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.n_heads = 3 does not divide model.hidden = 128" in err


def test_profile_writes_trace(tmp_path, dataset):
    cfg = small_config(tmp_path / "run", dataset, **{"train.max_steps": "4", "log.profile": "true",
                                                      "log.profile_steps": "1"})
    train(cfg)
    assert list((tmp_path / "run" / "profile").glob("trace-*.json"))


@pytest.mark.slow
def test_builtin_default_run_gets_below_60_percent_of_initial_val_loss(tmp_path, monkeypatch, capsys):
    """`fivefold train` with no arguments (the README's first command), as the foundation issue asks."""
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path / "cache"))
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--log.progress", "plain"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert max(val) == 450 and val[450] < 0.6 * val[0]
    assert "done: 450 steps" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_single_device_engine_recomputes(mode):
    """One process honours layout.recompute as the parallel engine does: the forward saves fewer bytes for
    backward than without recompute (the attention core's output or everything but the block inputs), and the
    gradients are the same."""
    from fivefold.train.build import build_engine

    def run(recompute: str) -> tuple[int, list[torch.Tensor]]:
        cfg = build_config(None, {"model.preset": "tiny", "layout.recompute": recompute, "train.device": "cpu",
                                  "train.seq_len": "32", "train.global_batch_size": "2"})
        engine = build_engine(cfg, torch.device("cpu"))
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
        saved = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = engine.micro_batch_loss(tokens[:, :-1], tokens[:, 1:], 64)
        loss.backward()
        return sum(saved), [p.grad.clone() for p in engine.parameters()]

    plain_bytes, plain_grads = run("none")
    bytes_, grads = run(mode)
    assert bytes_ < plain_bytes
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_progress_shows_elapsed_and_eta_and_the_run_ends_with_a_summary(tmp_path, dataset):
    import io

    out = io.StringIO()
    cfg = small_config(tmp_path / "run", dataset, **{"log.progress": "plain", "log.peak_tflops": "0.25",
                                                      "train.warmup_steps": "10"})
    result = train(cfg, stream=out)
    lines = out.getvalue().splitlines()
    assert any("warning: train.warmup_steps = 10 exceeds train.max_steps = 6" in line for line in lines)
    step_lines = [line for line in lines if line.startswith("step ") and " loss " in line]
    assert len(step_lines) == 6 and all("elapsed " in line and " eta " in line for line in step_lines)
    assert step_lines[-1].endswith("eta 0:00")
    summary = next(line for line in lines if line.startswith("summary:"))
    assert f"tokens seen {6 * 8 * 32:,}" in summary  # steps x global batch x sequence length
    assert "wall time " in summary and "tokens/s per device" in summary and "MFU " in summary
    assert "peak memory " in summary
    assert lines[-1].startswith("done: 6 steps") and f"final train loss {result.losses[-1]:.4f}" in lines[-1]
    assert f"val loss {result.val_losses[6]:.4f}" in lines[-1]
    # progress = none: no step lines, but the warning, the summary and the final line still show
    quiet = io.StringIO()
    train(small_config(tmp_path / "quiet", dataset, **{"log.progress": "none", "train.warmup_steps": "10"}),
          stream=quiet)
    lines = quiet.getvalue().splitlines()
    assert not any(line.startswith("step ") for line in lines)
    assert any("warning: train.warmup_steps" in line for line in lines) and lines[-1].startswith("done: 6 steps")


def test_default_threads_divide_the_cores_among_local_processes():
    import os

    from fivefold.train.loop import default_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_threads(1) == cores and default_threads(cores * 2) == 1
    assert default_threads(2) == max(1, cores // 2)


def test_tensorboard_and_wandb_offline_write_their_files(tmp_path, dataset, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "3", "log.tensorboard": "true", "log.wandb": "true"}))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)
    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    assert [p for p in wandb_runs[0].glob("run-*.wandb") if p.stat().st_size > 0]


def test_missing_logging_package_is_refused_before_anything_is_written(tmp_path, dataset, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb"
                        else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb = true needs the wandb package.*fivefold\[wandb\]"):
        train(small_config(tmp_path / "run", dataset, **{"log.wandb": "true"}))
    assert not (tmp_path / "run").exists()


def test_hf_init_refuses_data_prepared_with_another_tokenizer(tmp_path, dataset):
    from fivefold.data import DataError
    from fivefold.data.format import tokenizer_fingerprint

    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "1"}))
    assert tokenizer_fingerprint(run / "tokenizer" / "tokenizer.json") == tokenizer_fingerprint(
        dataset / "tokenizer.json")
    assert main(["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf")]) == 0
    # the same tokenizer: accepted, and the run keeps the model's tokenizer files
    train(small_config(tmp_path / "same", dataset, **{"train.max_steps": "1"}), hf_init=tmp_path / "hf")
    assert (tmp_path / "same" / "tokenizer" / "tokenizer_config.json").is_file()
    # another tokenizer (trained on other text): refused before the run directory is written
    (tmp_path / "other.txt").write_text("a completely different corpus of words and more words " * 400)
    other = prepare_dataset([tmp_path / "other.txt"], tmp_path / "other", vocab_size=300, val_fraction=0.1)
    with pytest.raises(DataError, match="prepared with another tokenizer than the model's"):
        train(small_config(tmp_path / "r", other, **{"train.max_steps": "1"}), hf_init=tmp_path / "hf")
    assert not (tmp_path / "r").exists()


def test_a_slow_background_save_holds_the_state_of_its_step(tmp_path, dataset, monkeypatch):
    """On the CPU the asynchronous save writes the live weights and moments without a copy; the next optimizer step
    waits until the writer has handed them to the file. With a writer slowed down by a second per save, the checkpoint
    of step 3 still holds step 3's state: resumed from it, steps 4-6 equal the uninterrupted run's bit for bit
    (without the wait the writer would read weights that step 4 had already changed)."""
    import time

    from fivefold.train import checkpoint as ckpt

    full = train(small_config(tmp_path / "full", dataset))
    write = ckpt.write_rank_files

    def slow(real):
        def call(*args, **kwargs):
            time.sleep(1.0)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(ckpt, "write_rank_files", slow(write))
    cut = small_config(tmp_path / "cut", dataset, **{"train.async_checkpoint": "true"})
    first = train(cut, stop_after=5)  # the save of step 3 in the background, while steps 4 and 5 run
    monkeypatch.setattr(ckpt, "write_rank_files", write)
    assert first.losses == full.losses[:5]
    for newer in ckpt.list_checkpoints(tmp_path / "cut"):  # keep step 3's checkpoint only
        if newer.name != "step_00000003":
            shutil.rmtree(newer)
    rest = train(small_config(tmp_path / "cut", dataset), resume=True)
    assert rest.losses == full.losses[3:]
