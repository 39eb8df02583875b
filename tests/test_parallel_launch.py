"""`fivefold train --nproc 2` end to end (PyTorch's launcher, gloo, the data pipeline, checkpoints), against the
same run in one process; exact resume of sharded runs; and the SLURM script that `fivefold train --slurm` writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.distributed import run_ranks
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

from fivefold.cli import main
from fivefold.train.checkpoint import latest_checkpoint, read_model_state
from fivefold.train.loop import train

SRC = Path(__file__).resolve().parents[1] / "src"


def test_train_nproc_2_matches_one_process(tmp_path, dataset):  # noqa: F811
    overrides = {"train.max_steps": "4", "train.checkpoint_every": "0", "train.dtype": "fp32",
                 "train.device": "cpu", "train.threads": "1"}
    single = train(small_config(tmp_path / "one", dataset, **overrides))
    args = [f"--{k}={v}" for k, v in overrides.items()]
    cmd = [sys.executable, "-m", "fivefold", "train", "--nproc", "2", "--data", str(dataset),
           "--run-dir", str(tmp_path / "two"), "--layout.dp", "2", "--layout.zero", "1", "--layout.micro_batch_size",
           "2", "--model.n_layers", "2", "--model.hidden", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
           "--model.ffn", "128", "--model.vocab_size", "512", "--train.seq_len", "32", "--train.global_batch_size",
           "8", "--train.warmup_steps", "2", "--train.eval_every", "0", "--train.eval_batches", "2",
           "--log.log_every", "1", "--log.progress", "none", *args]
    records = assert_cli_run_matches(cmd, tmp_path / "two", single)
    assert all(len(r["peak_memory_bytes_per_rank"]) == 2 for r in records if "loss" in r)


def _run_dir_each_rank_joins(rank: int, world_size: int) -> str:
    from fivefold.config import build_config
    from fivefold.launch import start_or_join

    cfg = build_config(None, {"train.device": "cpu"})
    cfg.run_dir = f"runs/tiny-20261129-09470{8 + (rank > 0)}"  # the default, named a second apart (a torchrun start)
    assert start_or_join(cfg, 1, [], "train") is None  # in a launcher's process: joins the group
    return cfg.run_dir


def test_torchrun_ranks_train_into_rank_0s_run_dir():
    """`torchrun ... -m fivefold train` without --run-dir (the README's command): every rank takes rank 0's default
    run directory, where a rank that named its own a second later wrote its checkpoint into a missing directory."""
    assert run_ranks(2, _run_dir_each_rank_joins) == ["runs/tiny-20261129-094708"] * 2


def assert_cli_run_matches(cmd: list[str], run_dir: Path, single) -> list[dict]:
    """Run the `fivefold train --nproc N ...` command `cmd` (writing `run_dir`) and check its logged losses,
    validation losses and checkpointed model against the one-process run `single` (losses to 1e-5, each tensor of the
    model to 1e-4 by norm); the checkpoint holds one optimizer shard per rank. Returns the
    metrics records."""
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == len(single.losses)
    for a, b in zip(losses, single.losses, strict=True):
        assert abs(a - b) <= 1e-5 * b
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert vals.keys() == single.val_losses.keys()
    assert all(abs(vals[k] - single.val_losses[k]) <= 1e-5 * single.val_losses[k] for k in vals)
    # the checkpoint holds the full plain-named model, equal to the one-process run's, and one optimizer shard
    # per rank
    two, one = latest_checkpoint(run_dir), latest_checkpoint(single.run_dir)
    a, b = read_model_state(two), read_model_state(one)
    assert a.keys() == b.keys()
    # per tensor by norm, as tests/test_parallel_equivalence.py argues (AdamW turns the fp32 rounding of a nearly
    # cancelling gradient element into an update error of up to lr; measured 1e-5 to 1e-4 for single elements)
    assert all((a[k] - b[k]).norm() <= 1e-4 * b[k].norm() for k in a)
    assert sorted(p.name for p in two.glob("rank*.safetensors")) == [
        "rank0.safetensors", "rank1.safetensors"]
    return records


def test_slurm_script_runs_torchrun_on_every_node(tmp_path, capsys):
    script = tmp_path / "job.sh"
    code = main(["train", "--slurm", str(script), "--nodes", "2", "--nproc", "4", "--layout.dp", "4",
                 "--layout.tp", "2", "--max-steps", "50", "--run-dir", "runs/big"])
    assert code == 0 and "sbatch" in capsys.readouterr().out
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    assert "srun torchrun" in text and "--nproc-per-node 4" in text and "--rdzv-backend c10d" in text
    # SIGTERM 120 s before the time limit, forwarded to srun (which passes it on to torchrun and the ranks)
    assert "#SBATCH --signal=B:TERM@120" in text and "kill -TERM \"$job\"" in text
    assert "--module fivefold train --max-steps 50 --run-dir runs/big --layout.dp 4 --layout.tp 2" in text
    # the layout is checked against nodes x processes before the script is written
    assert main(["train", "--slurm", str(tmp_path / "bad.sh"), "--nodes", "2", "--nproc", "4",
                 "--layout.dp", "2"]) == 2
    assert not (tmp_path / "bad.sh").exists()
    # a CPU run's job asks SLURM for no GPU, and still starts its processes per node
    cpu = tmp_path / "cpu.sh"
    assert main(["train", "--slurm", str(cpu), "--nodes", "2", "--nproc", "4", "--layout.dp", "8",
                 "--train.device", "cpu", "--max-steps", "50", "--run-dir", "runs/cpu"]) == 0
    text = cpu.read_text()
    assert "--gpus-per-node" not in text and "--nproc-per-node 4" in text


def resume_on_ranks(rank: int, world_size: int, data_dir: Path, tmp: Path, layout: dict[str, str]) -> tuple:
    """The uninterrupted run and the run cut after step 3 then resumed, under `layout`, on these ranks."""
    extra = {"train.dtype": "fp32", "train.device": "cpu", "layout.micro_batch_size": "2", **layout}
    full = train(small_config(tmp / "full", data_dir, **extra))
    first = train(small_config(tmp / "cut", data_dir, **extra), stop_after=3)
    rest = train(small_config(tmp / "cut", data_dir, **extra), resume=True)
    return full.losses, first.losses + rest.losses, full.val_losses[6], rest.val_losses[6]


def check_resume(tmp_path: Path, data_dir: Path, world_size: int, layout: dict[str, str]) -> None:
    full, resumed, val_full, val_resumed = run_ranks(world_size, resume_on_ranks, data_dir, tmp_path, layout)[0]
    assert full == resumed and val_full == val_resumed  # bit for bit
    a = read_model_state(latest_checkpoint(tmp_path / "full"))
    b = read_model_state(latest_checkpoint(tmp_path / "cut"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_resume_under_zero3_is_exact(tmp_path, dataset):  # noqa: F811
    check_resume(tmp_path, dataset, 2, {"layout.dp": "2", "layout.zero": "3"})


@pytest.mark.slow
def test_resume_under_tensor_parallel_and_zero2_is_exact(tmp_path, dataset):  # noqa: F811
    check_resume(tmp_path, dataset, 4, {"layout.dp": "2", "layout.tp": "2", "layout.zero": "2", "layout.sp": "true"})


def test_resume_under_context_parallel_and_zero3_is_exact(tmp_path, dataset):  # noqa: F811
    # ZeRO-3 shards over dp x cp; capacity-based MoE routing logs its drop rate; the balancing bias, written by
    # the first cp rank, is read back by both
    moe = {"model.n_experts": "4", "model.top_k": "2", "model.capacity_factor": "1.0", "model.bias_update_rate": "0.05"}
    check_resume(tmp_path, dataset, 2, {"layout.cp": "2", "layout.zero": "3", **moe})
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    drops = [r["moe_drop_fraction"] for r in records if "loss" in r]
    assert len(drops) == 6 and all(0 <= d < 0.5 for d in drops) and max(drops) > 0


@pytest.mark.slow
def test_resume_under_expert_parallel_and_zero2_is_exact(tmp_path, dataset):  # noqa: F811
    # every rank saves its own experts' optimizer states; the model file holds every expert; the balancing bias
    moe = {"model.n_experts": "4", "model.top_k": "2", "model.capacity_factor": "1.0", "model.bias_update_rate": "0.05"}
    check_resume(tmp_path, dataset, 2, {"layout.dp": "2", "layout.ep": "2", "layout.zero": "2", **moe})
    model = read_model_state(latest_checkpoint(tmp_path / "full"))
    assert model["layers.0.mlp.w_gate"].shape[0] == 4


def test_resume_under_plain_data_parallel_is_exact(tmp_path, dataset):  # noqa: F811
    # ZeRO-0: rank 0 writes the replicated optimizer state once and every rank loads it
    check_resume(tmp_path, dataset, 2, {"layout.dp": "2", "layout.zero": "0"})


def test_resume_under_context_parallel_and_zero0_is_exact(tmp_path, dataset):  # noqa: F811
    check_resume(tmp_path, dataset, 2, {"layout.cp": "2", "layout.zero": "0"})


def _world_sum(rank: int, world_size: int) -> int:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def test_run_ranks_starts_again_when_its_port_is_taken(monkeypatch):
    """The port `free_port` picked can be bound by another process before rank 0 listens on it: the ranks fail
    in init_process_group with "address already in use", and `run_ranks` starts them again on a new port."""
    import socket

    import tests.distributed as helper

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picked = []

        def free_port() -> int:  # the taken port first, then a free one
            picked.append(taken.getsockname()[1] if not picked else real())
            return picked[-1]

        real = helper.free_port
        monkeypatch.setattr(helper, "free_port", free_port)
        assert helper.run_ranks(2, _world_sum) == [3, 3]
        assert len(picked) == 2 and picked[0] == taken.getsockname()[1] != picked[1]


def validation_on_ranks(rank: int, world_size: int, data_dir: Path, tmp: Path) -> dict[int, float]:
    extra = {"train.dtype": "fp32", "train.device": "cpu", "train.global_batch_size": "18",
             "layout.micro_batch_size": "3", "train.max_steps": "1", "train.checkpoint_every": "0",
             "layout.pp": "2"}
    return train(small_config(tmp / "pp", data_dir, **extra)).val_losses


def test_pipeline_validates_rows_its_micro_batch_does_not_divide(tmp_path, dataset):  # noqa: F811
    """16 validation rows in micro-batches of 3 (the training batch: 18 rows, 6 micro-batches) once left a last
    micro-batch of 1, and the pipeline, which sends one shape per schedule, failed at step 0; they are now split
    into equal micro-batches (the largest size <= 3 that divides 16), and the validation loss is one process's."""
    val = run_ranks(2, validation_on_ranks, dataset, tmp_path)[0]
    one = train(small_config(tmp_path / "one", dataset, **{
        "train.dtype": "fp32", "train.device": "cpu", "train.global_batch_size": "18",
        "layout.micro_batch_size": "3", "train.max_steps": "1", "train.checkpoint_every": "0"})).val_losses
    assert val.keys() == one.keys() == {0, 1}
    assert all(abs(val[k] - one[k]) <= 1e-5 * one[k] for k in val)


@pytest.mark.parametrize(("flags", "said"), [
    (["--model.vocab_size", "1000"], "model.vocab_size 1000 is smaller than the vocabulary of the built-in corpus"),
    (["--data", "/nonexistent/prepared"], "data.path = '/nonexistent/prepared' is not a directory")])
def test_data_refused_before_the_processes_start(tmp_path, capsys, flags, said):
    """A multi-process run checks its data directory and vocabulary once, in the command the user started: one
    line, and no worker (each would print the refusal beside the launcher's own lines)."""
    rc = main(["train", "--nproc", "2", "--layout.dp", "2", "--max-steps", "2", "--run-dir", str(tmp_path / "r"),
               *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and said in err
    assert not (tmp_path / "r").exists()
