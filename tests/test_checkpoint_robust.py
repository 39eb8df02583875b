"""Checkpoints that survive: corrupt or incomplete newest checkpoints, leftovers of interrupted saves, a run killed
before its first checkpoint or with kill -9 during a save, a deleted config.toml, non-finite steps, SIGTERM. Every
resume is checked against the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

from fivefold.cli import main
from fivefold.train import checkpoint as ckpt
from fivefold.train.loop import EXIT_NON_FINITE, RunDirError, train

SRC = Path(__file__).resolve().parents[1] / "src"
EVERY_2 = {"train.checkpoint_every": "2", "train.keep_checkpoints": "3", "train.threads": "1"}


def logged_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, dataset, capsys):  # noqa: F811
    full = train(small_config(tmp_path / "full", dataset, **EVERY_2))
    train(small_config(tmp_path / "cut", dataset, **EVERY_2), stop_after=4)
    newest = ckpt.latest_checkpoint(tmp_path / "cut")
    assert newest.name == "step_00000004"
    weights = newest / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = random.Random(0).randbytes(64)  # same size: only the checksum can tell
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    rest = train(small_config(tmp_path / "cut", dataset, **EVERY_2), resume=True)
    err = capsys.readouterr().err
    assert "checkpoint step_00000004 cannot be used" in err and "rank0.safetensors is corrupted" in err
    assert "resuming from the newest good checkpoint, step_00000002" in err
    assert rest.losses == full.losses[2:]  # steps 3-6 again, bit for bit
    assert (tmp_path / "cut" / "checkpoints" / "step_00000004.bad").is_dir()  # kept for inspection, ignored
    assert logged_losses(tmp_path / "cut") == logged_losses(tmp_path / "full")


def test_incomplete_newest_and_leftovers_never_block(tmp_path, dataset):  # noqa: F811
    full = train(small_config(tmp_path / "full", dataset, **EVERY_2))
    train(small_config(tmp_path / "cut", dataset, **EVERY_2), stop_after=4)
    root = tmp_path / "cut" / "checkpoints"
    (root / "step_00000004" / "COMPLETE").unlink()  # a directory without its completion marker
    (root / "step_00000006.tmp").mkdir()  # a save killed half-way
    (root / "step_00000006.tmp" / "rank0.safetensors").write_bytes(b"\0" * 10)
    rest = train(small_config(tmp_path / "cut", dataset, **EVERY_2), resume=True)
    assert rest.losses == full.losses[2:]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004", "step_00000004.bad",
                                                      "step_00000006"]
    # the same leftover handled by the writer itself: no "already exists"
    (root / "step_00000006" / "COMPLETE").unlink()
    tmp = ckpt.begin_checkpoint(tmp_path / "cut", 6)
    assert tmp.name == "step_00000006.tmp" and (root / "step_00000006.bad").is_dir()


def test_only_bad_checkpoints_is_an_error_naming_each(tmp_path, dataset):  # noqa: F811
    train(small_config(tmp_path / "run", dataset, **EVERY_2), stop_after=4)
    for path in ckpt.list_checkpoints(tmp_path / "run"):
        (path / "rng-rank0.safetensors").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match=r"no usable checkpoint: .*step_00000004/rng-rank0.safetensors is "
                                                   r"corrupted.*step_00000002/rng-rank0.safetensors is corrupted"):
        train(small_config(tmp_path / "run", dataset, **EVERY_2), resume=True)
    assert not list((tmp_path / "run" / "checkpoints").glob("*.bad"))  # nothing moved on failure


def test_run_killed_before_its_first_checkpoint_restarts_in_place(tmp_path, dataset, capsys):  # noqa: F811
    full = train(small_config(tmp_path / "full", dataset))
    train(small_config(tmp_path / "cut", dataset), stop_after=1)  # first checkpoint would be at step 3
    assert not ckpt.checkpoint_dirs(tmp_path / "cut")
    with pytest.raises(RunDirError, match="--resume starts it again in place"):
        train(small_config(tmp_path / "cut", dataset))
    again = train(small_config(tmp_path / "cut", dataset), resume=True)
    assert "starting it again at step 0" in capsys.readouterr().err
    assert again.losses == full.losses
    assert logged_losses(tmp_path / "cut") == logged_losses(tmp_path / "full")


def test_deleted_config_toml(tmp_path, dataset, capsys):  # noqa: F811
    run = tmp_path / "run"
    cfg = small_config(run, dataset)
    train(cfg, stop_after=3)
    (run / "config.toml").unlink()
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4"]) == 0
    assert "config.toml is missing; using the config saved with checkpoint step_00000003" in capsys.readouterr().err
    (run / "config.toml").unlink()
    for path in ckpt.checkpoint_dirs(run):
        (path / "config.toml").unlink()
        (path / "COMPLETE").unlink()
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.toml is missing" in err and "Traceback" not in err


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, dataset, capsys):  # noqa: F811
    bad = {"train.lr": "10000", "train.grad_clip": "0", "train.warmup_steps": "2", "train.max_steps": "30",
           "train.lr_schedule": "constant",  # so that the reference run below, shorter, steps with the same rates
           "train.checkpoint_every": "10", "log.log_every": "10"}
    result = train(small_config(tmp_path / "nan", dataset, **bad))
    err = first_err = capsys.readouterr().err
    assert result.stopped == "non-finite" and result.exit_code == EXIT_NON_FINITE and result.steps < 30
    assert f"stopped at step {result.steps}" in err and "train.max_bad_steps = 5" in err
    assert result.skipped_steps >= 5
    first, last, in_row = map(int, re.search(r"steps (\d+) to (\d+) had a non-finite loss or gradient norm \((\d+) in "
                                             r"a row", err).groups())
    assert last - first + 1 == in_row >= 5 and last <= result.steps
    updated, _ = result.last_finite_loss
    # the kept checkpoint holds the weights of the last update: those of a run that stopped there
    ref = train(small_config(tmp_path / "ref", dataset, **{**bad, "train.max_steps": str(updated)}))
    kept = ckpt.latest_checkpoint(tmp_path / "nan")
    assert kept.name == f"step_{result.steps:08d}"
    assert f"continue from {kept.name} with `fivefold train --resume --run-dir {tmp_path / 'nan'}`" in first_err
    a = ckpt.read_model_state(kept)
    b = ckpt.read_model_state(ckpt.latest_checkpoint(tmp_path / "ref"))
    assert all(torch.isfinite(v).all() for v in a.values()) and all(torch.equal(a[k], b[k]) for k in a)
    assert ref.last_finite_loss == result.last_finite_loss
    assert json.loads((kept / "trainer_state.json").read_text())["skipped_steps"] == result.skipped_steps
    cli = run_cli(tmp_path / "cli", dataset, 30, "--train.lr", "10000", "--train.grad_clip", "0",
                  "--train.checkpoint_every", "10")
    _, err = cli.communicate(timeout=300)
    # logging every step, the host reads each step's flags at once: it stops at the fifth bad step in a row, where
    # the run above (reading them every 10 steps) stopped at the next logging step
    first_bad = int(re.search(r"steps (\d+) to \d+ had a non-finite", first_err)[1])
    assert cli.returncode == EXIT_NON_FINITE and f"stopped at step {first_bad + 4}." in err, err[-2000:]


def train_argv(run_dir: Path, data: Path, steps: int, *extra: str) -> list[str]:
    """`fivefold train` arguments of a small run (small_config's model) that logs and checkpoints every step."""
    return ["train", "--data", str(data), "--run-dir", str(run_dir), "--max-steps", str(steps), "--model.n_layers",
            "2", "--model.hidden", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn", "128",
            "--model.vocab_size", "512", "--train.seq_len", "32", "--train.global_batch_size", "8",
            "--layout.micro_batch_size", "4", "--train.warmup_steps", "2", "--train.eval_every", "0",
            "--train.eval_batches", "2", "--log.log_every", "1", "--log.progress", "none", "--train.threads", "1",
            "--train.checkpoint_every", "1", *extra]


def run_cli(run_dir: Path, data: Path, steps: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fivefold", *train_argv(run_dir, data, steps, *extra)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})


def test_sigterm_checkpoints_and_resume_continues(tmp_path, dataset):  # noqa: F811
    steps = 150
    full = train(small_config(tmp_path / "full", dataset, **{"train.max_steps": str(steps), "train.threads": "1"}))
    run = tmp_path / "cut"
    proc = run_cli(run, dataset, steps, "--train.checkpoint_every", "0")
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and logged_losses(run)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped = ckpt.latest_checkpoint(run)
    step = int(stopped.name.removeprefix("step_"))
    assert 1 <= step < steps and f"stopped by SIGTERM after step {step}" in err
    resumed = run_cli(run, dataset, steps, "--resume", "--train.checkpoint_every", "0")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert list(logged_losses(run).values()) == full.losses  # bit for bit


def saving(run: Path) -> bool:
    """Whether a checkpoint is being written (a `step_*.tmp` directory)."""
    try:
        return any(p.name.endswith(".tmp") for p in (run / "checkpoints").iterdir())
    except OSError:
        return False


def kill_during_saves(tmp_path: Path, data: Path, tries: int, seed: int, *extra: str, in_save: bool = False) -> None:
    """Kill -9 the run at random moments (it saves after every step), resume after each kill; every resume must start
    from a complete checkpoint and the losses must be the uninterrupted run's. `in_save`: the kill lands while a
    checkpoint's `.tmp` directory exists (with asynchronous saves, while training goes on beside the write)."""
    steps = 12
    full = train(small_config(tmp_path / "full", data, **{"train.max_steps": str(steps), "train.threads": "1",
                                                          "train.checkpoint_every": "1"}))
    run, rng = tmp_path / "cut", random.Random(seed)
    kills_in_save = 0
    for attempt in range(tries):
        proc = run_cli(run, data, steps, *extra, *(["--resume"] if attempt else []))
        started = time.time()
        while time.time() - started < 120 and not (run / "metrics.jsonl").is_file():
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))
        while in_save and not saving(run) and proc.poll() is None and time.time() - started < 120:
            time.sleep(0.001)
        kills_in_save += saving(run) and proc.poll() is None
        proc.kill()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode in (-signal.SIGKILL, 0), err[-2000:]
        assert "cannot be used" not in err  # never a half-written checkpoint taken for a complete one
        if proc.returncode == 0:
            break
    done = run_cli(run, data, steps, *extra, "--resume")
    _, err = done.communicate(timeout=300)
    if done.returncode != 0:  # the last try had finished the run already
        assert "not before train.max_steps" in err, err[-2000:]
    assert "cannot be used" not in err
    assert list(logged_losses(run).values()) == full.losses  # bit for bit
    assert kills_in_save or not in_save  # at least one kill landed while a checkpoint was being written
    for path in ckpt.list_checkpoints(run):
        ckpt.verify_files(path)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_kill_9_during_saves_fast(tmp_path, dataset, mode):  # noqa: F811
    kill_during_saves(tmp_path, dataset, 2, 1, "--train.async_checkpoint", str(mode == "async").lower())


def test_kill_9_during_an_asynchronous_save_resumes_from_the_newest_complete(tmp_path, dataset):  # noqa: F811
    kill_during_saves(tmp_path, dataset, 3, 3, "--train.async_checkpoint", "true", in_save=True)


@pytest.mark.slow
def test_kill_9_during_saves_ten_tries(tmp_path, dataset):  # noqa: F811
    kill_during_saves(tmp_path, dataset, tries=10, seed=2)


def test_pruning_killed_half_way_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """Pruning renames a checkpoint before deleting it: a kill during the deletion leaves a `*.deleting` directory,
    which no reader takes for a checkpoint and the next pruning removes."""
    from tests.test_checkpoint import _save, _trained_state

    cfg, engine = _trained_state(0)
    cfg.train.keep_checkpoints = 3  # the saves keep all three; the pruning below is the one killed
    for step in (1, 2, 3):
        _save(tmp_path, step, engine, cfg)
    real_rmtree = ckpt.shutil.rmtree

    def dying_rmtree(path, *a, **k):
        (Path(path) / "rank0.json").unlink()  # one file gone, then killed
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt.shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune_checkpoints(tmp_path, 2)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    for path in ckpt.list_checkpoints(tmp_path):
        ckpt.verify_files(path)
    ckpt.prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]


def damaged_newest(tmp_path: Path, dataset: Path, damage) -> tuple[list[float], Path]:  # noqa: F811
    """The uninterrupted run's losses and a run cut at step 4 whose newest checkpoint `damage(step_4)` changed and
    re-recorded in its manifest (sizes and checksums that agree: only the content can tell)."""
    full = train(small_config(tmp_path / "full", dataset, **EVERY_2))
    train(small_config(tmp_path / "cut", dataset, **EVERY_2), stop_after=4)
    newest = ckpt.latest_checkpoint(tmp_path / "cut")
    assert newest.name == "step_00000004"
    damage(newest)
    ckpt.write_manifest(newest)
    return full.losses, newest


def edit_index(path: Path, change) -> None:
    """Change rank 0's part of the index, and the checkpoint's one index merged from the parts (as a save writes it)."""
    from fivefold.checkpoint_format import global_index

    index = json.loads((path / "rank0.json").read_text())
    change(index)
    (path / "rank0.json").write_text(json.dumps(index))
    parts = [json.loads(f.read_text()) for f in sorted(path.glob("rank*.json"))]
    (path / "index.json").write_text(json.dumps({"format_version": ckpt.FORMAT_VERSION, **global_index(parts)}))


def resumes_from_step_2(tmp_path: Path, dataset: Path, full_losses: list[float], capsys, why: str) -> None:  # noqa: F811
    capsys.readouterr()
    rest = train(small_config(tmp_path / "cut", dataset, **EVERY_2), resume=True)
    err = capsys.readouterr().err
    assert re.search(r"checkpoint step_00000004 cannot be used \(.*" + why, err), err
    assert "resuming from the newest good checkpoint, step_00000002" in err
    assert rest.losses == full_losses[2:]  # steps 3-6 again, bit for bit: the older weights, not the others
    assert (tmp_path / "cut" / "checkpoints" / "step_00000004.bad").is_dir()


@pytest.mark.parametrize("target", ["../step_00000002/rank0.safetensors", "/abs/rank0.safetensors", "link"])
def test_piece_index_pointing_outside_the_checkpoint_falls_back(tmp_path, dataset, capsys, target):  # noqa: F811
    def point_outside(path: Path) -> None:
        if target == "link":  # a link inside the directory that leads out of it
            (path / "link").symlink_to(path.parent / "step_00000002" / "rank0.safetensors")
        edit_index(path, lambda index: index.update(file=target if target != "/abs/rank0.safetensors" else
                                                    str(path.parent / "step_00000002" / "rank0.safetensors")))

    full_losses, newest = damaged_newest(tmp_path, dataset, point_outside)
    # export refuses the same checkpoint through the same check
    assert main(["export", "--checkpoint", str(newest), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "not a relative name inside the directory" in err or "resolves outside the directory" in err, err
    resumes_from_step_2(tmp_path, dataset, full_losses, capsys, "inside the directory|outside the directory")


def test_index_at_odds_with_its_own_config_falls_back(tmp_path, dataset, capsys):  # noqa: F811
    def reshape(path: Path) -> None:
        def change(index):
            piece = next(p for p in index["pieces"] if p["name"] == "model.norm.weight")
            piece["shape"] = piece["piece_shape"] = [32]
        edit_index(path, change)

    full_losses, _ = damaged_newest(tmp_path, dataset, reshape)
    resumes_from_step_2(tmp_path, dataset, full_losses, capsys, "disagrees with its own config.toml")


def test_checkpoint_with_non_finite_weights_falls_back(tmp_path, dataset, capsys):  # noqa: F811
    from safetensors.torch import load_file, save_file

    def poison(path: Path) -> None:
        tensors = load_file(str(path / "rank0.safetensors"))
        tensors["0"] = torch.full_like(tensors["0"], float("nan"))
        save_file(tensors, str(path / "rank0.safetensors"))
        edit_index(path, lambda index: index.update(sha256=ckpt.file_sha256(path / "rank0.safetensors")))

    full_losses, newest = damaged_newest(tmp_path, dataset, poison)
    # the reference: the tensor whose piece is key "0" of rank 0's file, as rank 0's piece index records it
    name = next(p["name"] for p in json.loads((newest / "rank0.json").read_text())["pieces"] if p["key"] == "0")
    resumes_from_step_2(tmp_path, dataset, full_losses, capsys,
                        re.escape(f"holds NaN or inf in its weights or optimizer state, first in tensor '{name}')"))


def train_on_ranks(rank: int, world: int, run_dir: Path, data: Path, overrides: dict[str, str], resume: bool) -> str:
    """A run on gloo ranks (`tests.distributed.run_ranks`); what a refused resume said on this rank, or "trained"."""
    try:
        train(small_config(run_dir, data, **overrides), resume=resume)
    except ckpt.CheckpointError as e:
        return str(e)
    return "trained"


def test_non_finite_state_of_another_rank_is_named_with_that_rank_on_every_rank(tmp_path, dataset):  # noqa: F811
    """dp2 x ZeRO-1: each rank writes its own shards of the weights and AdamW state, and checks those. A NaN in the
    first piece rank 1 wrote (its file re-recorded in the index and the manifest, so only the values can tell) is
    found by rank 1 when a resume loads it; every rank's refusal names that tensor and rank 1."""
    from safetensors.torch import load_file, save_file
    from tests.distributed import run_ranks

    from fivefold.checkpoint_format import global_index

    overrides = {**EVERY_2, "train.dtype": "fp32", "train.device": "cpu", "layout.dp": "2", "layout.zero": "1",
                 "train.max_steps": "2"}
    assert run_ranks(2, train_on_ranks, tmp_path / "run", dataset, overrides, False) == ["trained"] * 2
    path = ckpt.latest_checkpoint(tmp_path / "run")
    part = json.loads((path / "rank1.json").read_text())
    tensors = load_file(str(path / "rank1.safetensors"))
    tensors["0"] = torch.full_like(tensors["0"], float("nan"))
    save_file(tensors, str(path / "rank1.safetensors"))
    part["sha256"] = ckpt.file_sha256(path / "rank1.safetensors")
    (path / "rank1.json").write_text(json.dumps(part))
    parts = [json.loads(f.read_text()) for f in sorted(path.glob("rank*.json"))]
    (path / "index.json").write_text(json.dumps({"format_version": ckpt.FORMAT_VERSION, **global_index(parts)}))
    ckpt.write_manifest(path)
    # the reference: the tensor of key "0" in rank 1's file, as rank 1's piece index records it
    name = next(p["name"] for p in part["pieces"] if p["key"] == "0")
    said = run_ranks(2, train_on_ranks, tmp_path / "run", dataset, overrides, True)
    assert said[0] == said[1] and said[0].startswith("--resume: no usable checkpoint: "), said
    assert (f"holds NaN or inf in its weights or optimizer state, first in tensor '{name}', found by rank 1 of 2"
            in said[0]), said
