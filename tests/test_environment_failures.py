"""Failures of the machine, not of the input: a full disk or a read-only `checkpoints/` at save time, a
`checkpoints/` that cannot be written at start-up, a rank that never joins the job, a rank killed mid-run. Each
ends in one line that says what failed, where, what is safe on disk and how to continue, and leaves the older
checkpoints intact with no `.tmp` holding space."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from tests.test_train import dataset  # noqa: F401  (a fixture)

from fivefold.cli import main
from fivefold.errors import EXIT_ENVIRONMENT, EnvironmentFailure
from fivefold.faults import wait_for_ranks
from fivefold.train import checkpoint as ckpt

SRC = Path(__file__).resolve().parents[1] / "src"


def train_argv(run_dir: Path, data: Path, steps: int = 4, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--run-dir", str(run_dir), "--max-steps", str(steps), "--model.n_layers",
            "2", "--model.hidden", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn", "128",
            "--model.vocab_size", "512", "--train.seq_len", "32", "--train.global_batch_size", "8",
            "--layout.micro_batch_size", "4", "--train.warmup_steps", "2", "--train.eval_every", "0",
            "--train.eval_batches", "2", "--log.log_every", "1", "--log.progress", "none", "--train.threads", "1",
            "--train.checkpoint_every", "2", "--train.keep_checkpoints", "3", *extra]


def fails_at_step_4_with_one_line(run: Path, capsys, cause: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert "could not write the checkpoint of step 4" in line and cause in line, line
    assert f"the newest complete checkpoint, {run / 'checkpoints' / 'step_00000002'}, is intact" in line, line
    assert f"`fivefold train --resume --run-dir {run}`" in line, line
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]  # no .tmp left holding the space
    ckpt.verify_files(root / "step_00000002")  # every file of the older checkpoint as its manifest says
    return line


def test_full_disk_at_save_time(tmp_path, dataset, capsys, monkeypatch):  # noqa: F811
    real = ckpt.write_safetensors
    calls = []

    def filling(path, tensors, **kwargs):
        calls.append(path)
        if "step_00000004" in str(path):  # the second checkpoint: half a file, then the disk is full
            Path(path).write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(ckpt, "write_safetensors", filling)
    run = tmp_path / "run"
    assert main(train_argv(run, dataset)) == EXIT_ENVIRONMENT
    fails_at_step_4_with_one_line(run, capsys, "No space left on device (ENOSPC)")
    monkeypatch.setattr(ckpt, "write_safetensors", real)
    assert main(train_argv(run, dataset, 4, "--resume")) == 0  # space freed: it continues from step 2
    assert ckpt.latest_checkpoint(run).name == "step_00000004"


def filling_at_step_4(path, tensors, real=ckpt.write_safetensors, **kwargs):
    if "step_00000004" in str(path):
        Path(path).write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real(path, tensors, **kwargs)


def test_full_disk_during_an_asynchronous_save(tmp_path, dataset, capsys, monkeypatch):  # noqa: F811
    """Step 4's checkpoint, written in the background, meets a full disk: the next save (step 6's) reports it in one
    line, its partial files removed, step 2's intact; nothing newer is written."""
    monkeypatch.setattr(ckpt, "write_safetensors", filling_at_step_4)
    run = tmp_path / "run"
    assert main(train_argv(run, dataset, 6, "--train.async_checkpoint", "true")) == EXIT_ENVIRONMENT
    fails_at_step_4_with_one_line(run, capsys, "No space left on device (ENOSPC)")


def fail_on_rank_1(rank: int, world: int, run: Path, data: Path) -> tuple[int, list[str]]:
    if rank == 1:
        ckpt.write_safetensors = filling_at_step_4
    code = main([*train_argv(run, data, 6, "--train.async_checkpoint", "true"), "--layout.dp", "2"])
    return code, sorted(p.name for p in (run / "checkpoints").iterdir())


def test_a_rank_failing_its_asynchronous_part_fails_the_save_on_every_rank(tmp_path, dataset):  # noqa: F811
    """Rank 1 cannot write its part of step 4's background save: the first rank's finishing thread sees its marker
    and gives up, every rank raises at the next save with the older checkpoint intact and no partial files left."""
    from tests.distributed import run_ranks

    run = tmp_path / "run"
    results = run_ranks(2, fail_on_rank_1, run, dataset)
    assert [code for code, _ in results] == [EXIT_ENVIRONMENT] * 2
    assert all(names == ["step_00000002"] for _, names in results), results
    ckpt.verify_files(run / "checkpoints" / "step_00000002")


def test_read_only_checkpoints_at_save_time(tmp_path, dataset, capsys, monkeypatch):  # noqa: F811
    """The file system turns read-only under `checkpoints/` after the first checkpoint (patched: chmod does not
    stop root)."""
    real = pathlib.Path.mkdir

    def read_only(self, *a, **k):
        if self.name == "step_00000004.tmp":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    run = tmp_path / "run"
    assert main(train_argv(run, dataset)) == EXIT_ENVIRONMENT
    fails_at_step_4_with_one_line(run, capsys, "Read-only file system (EROFS)")


@pytest.mark.skipif(os.geteuid() == 0, reason="chmod does not stop root")
def test_chmod_read_only_checkpoints(tmp_path, dataset, capsys):  # noqa: F811
    run = tmp_path / "run"
    assert main(train_argv(run, dataset, 2)) == 0
    (run / "checkpoints").chmod(0o555)
    try:
        capsys.readouterr()
        assert main(train_argv(run, dataset, 4, "--resume")) == 2  # the preflight sees it before any step
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "checkpoints' cannot be written" in err, err
    finally:
        (run / "checkpoints").chmod(0o755)


def test_preflight_checks_checkpoints_too(tmp_path, dataset, capsys, monkeypatch):  # noqa: F811
    run = tmp_path / "run"
    assert main(train_argv(run, dataset, 2)) == 0
    real = pathlib.Path.write_text

    def forbidden(self, *a, **k):
        if self.parent.name == "checkpoints":
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", forbidden)
    capsys.readouterr()
    assert main(train_argv(run, dataset, 4, "--resume")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--run-dir '{run / 'checkpoints'}' cannot be written (Permission denied)" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_rank_that_never_joins_is_named_within_the_timeout(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=r"ranks 1, 2 of 3 did not join the job within "
                                                 r"train.collective_timeout_s = 2 s"):
        wait_for_ranks(0, 3, 2.0)
    assert time.monotonic() - start < 3.0  # within the configured timeout, not a multiple of it


def test_killed_rank_is_named_by_the_launcher_without_a_traceback(tmp_path, dataset):  # noqa: F811
    """kill -9 of rank 1 mid-run: rank 0 says in one line that it lost a rank, and the launcher's summary names
    rank 1 as the one that failed first."""
    run = tmp_path / "run"
    argv = train_argv(run, dataset, 400, "--nproc", "2", "--layout.dp", "2", "--train.checkpoint_every", "0",
                      "--train.collective_timeout_s", "60")
    job = subprocess.Popen([sys.executable, "-m", "fivefold", *argv], stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(SRC)})
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or (run / "metrics.jsonl").stat().st_size < 400:
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.2)
        children = subprocess.run(["pgrep", "-f", f"fivefold.*--run-dir {run}"], capture_output=True, text=True)
        ranks = {}
        for pid in map(int, children.stdout.split()):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                ranks[rank] = pid
        os.kill(ranks[1], 9)
        _, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    summary = [line for line in err.splitlines() if line.startswith("fivefold: rank")]
    assert summary and summary[-1].startswith("fivefold: rank 1 failed first: killed by SIGKILL"), err[-3000:]
