"""One owner per run directory, and the signals that stop a run: a second `fivefold train` (fresh or `--resume`) of a
run directory in use is refused naming its holder while the holder's log keeps every step; a lock of a dead holder
is free; SIGHUP stops a one-process run and the launcher of `--nproc 2` with a checkpoint of the current step (exit
129); a second stop signal abandons the save, names the newest complete checkpoint, and resume continues from it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.test_checkpoint_robust import SRC, run_cli, train_argv
from tests.test_faults import _alive, _start_training
from tests.test_train import dataset  # noqa: F401  (a fixture)

from fivefold.cli import main
from fivefold.faults import RUN_LOCK, RunDirBusy, RunLock
from fivefold.train import checkpoint as ckpt


def logged_steps(run: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def wait_for_lock(run: Path, proc: subprocess.Popen) -> dict:
    """The holder's record once `proc` holds the run directory's lock."""
    deadline = time.monotonic() + 240
    while True:
        try:
            holder = json.loads((run / RUN_LOCK).read_text())
            if holder["pid"] == proc.pid:
                return holder
        except (OSError, ValueError):
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.05)


def refused_while_held(run: Path, first: subprocess.Popen, second: list[str]) -> None:
    """With `first` holding `run` (stopped with SIGSTOP, so it holds it for sure), the command `second` exits 2 in
    one line naming first's host, pid and start time; then `first` goes on and ends well, its log whole."""
    holder = wait_for_lock(run, first)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        done = subprocess.run([sys.executable, "-m", "fivefold", *second], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert (f"is in use by pid {first.pid} on host {socket.gethostname()}, started {holder['started']}"
            in lines[0]), lines[0]
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]


def test_second_resume_of_a_run_in_use_is_refused_naming_the_holder(tmp_path, dataset):  # noqa: F811
    run = tmp_path / "run"
    _, err = (start := run_cli(run, dataset, 3)).communicate(timeout=300)
    assert start.returncode == 0, err[-2000:]
    first = run_cli(run, dataset, 10, "--resume")
    refused_while_held(run, first, train_argv(run, dataset, 10, "--resume"))
    assert logged_steps(run) == list(range(1, 11))  # every step once: nobody else cut or replaced the log
    assert not (run / RUN_LOCK).exists()  # released when the run ended


def test_second_fresh_run_into_a_directory_in_use_is_refused_naming_the_holder(tmp_path, dataset):  # noqa: F811
    run = tmp_path / "new" / "run"  # created by the first run's lock
    first = run_cli(run, dataset, 6)
    refused_while_held(run, first, train_argv(run, dataset, 6))
    assert logged_steps(run) == list(range(1, 7))
    assert [p.name for p in ckpt.list_checkpoints(run)][-1] == "step_00000006"


def test_lock_of_a_dead_holder_is_free_and_a_live_one_is_not(tmp_path):
    run = tmp_path / "run"
    # a holder killed with SIGKILL: its lock file stays, with its pid, but the kernel released the lock
    code = f"import os; from fivefold.faults import RunLock; RunLock({str(run)!r}).acquire(); os.kill(os.getpid(), 9)"
    dead = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(SRC)})
    assert dead.returncode == -signal.SIGKILL and (run / RUN_LOCK).is_file()
    with RunLock(run):
        assert json.loads((run / RUN_LOCK).read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirBusy, match=f"in use by pid {os.getpid()} on host "):
            RunLock(run).acquire()  # another open file of the same process conflicts too (flock)
    assert not (run / RUN_LOCK).exists() and run.is_dir()  # the directory was there before: kept
    with RunLock(tmp_path / "a" / "b"):
        pass
    assert not (tmp_path / "a").exists()  # created by the lock, nothing written: removed again


def stopped_step(err: str, name: str) -> int:
    found = re.search(rf"stopped by {name} after step (\d+) with a checkpoint", err)
    assert found, err[-3000:]
    return int(found[1])


def test_sighup_stops_one_process_with_a_checkpoint_of_the_current_step(tmp_path, dataset):  # noqa: F811
    run = tmp_path / "run"
    proc = run_cli(run, dataset, 200, "--train.checkpoint_every", "0")
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").is_file() and logged_steps(run)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP == 129, err[-2000:]
    step = stopped_step(err, "SIGHUP")
    assert [p.name for p in ckpt.list_checkpoints(run)] == [f"step_{step:08d}"]
    assert logged_steps(run)[-1] == step  # the step it was in, finished and saved
    ckpt.verify_files(ckpt.latest_checkpoint(run))
    assert f"continue with `fivefold train --resume --run-dir {run}`" in err


def test_sighup_to_the_launcher_of_two_processes_checkpoints_and_exits_129(tmp_path):
    run = tmp_path / "run"
    proc, workers = _start_training(run, 600.0)
    assert json.loads((run / RUN_LOCK).read_text())["pid"] == proc.pid  # the launcher owns the run
    os.kill(proc.pid, signal.SIGHUP)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 129, out[-3000:]
    step = stopped_step(out, "SIGHUP")
    assert ckpt.latest_checkpoint(run).name == f"step_{step:08d}" and logged_steps(run)[-1] == step
    ckpt.verify_files(ckpt.latest_checkpoint(run))
    assert f"continue with `fivefold train --resume --run-dir {run} --nproc 2`" in out
    assert "stopped by SIGHUP; the 2 processes were stopped" in out and "Traceback" not in out
    assert not any(_alive(p) for p in workers) and not (run / RUN_LOCK).exists()


def test_second_signal_during_the_save_abandons_it(tmp_path, dataset, monkeypatch, capsys):  # noqa: F811
    """SIGTERM during step 2's save asks the run to stop; a second SIGTERM during the save of step 3 that follows
    abandons it: one line naming step 2's checkpoint, exit 143, and resume continues from step 2. Synchronous saves:
    a background save of step 2 would be given up by the stop's save whenever it is still being written (that case
    is `test_stop_gives_up_the_background_save_in_flight`'s), which made this test depend on the machine's load."""
    run = tmp_path / "run"
    real, saves = ckpt.write_rank_files, []

    def signalling_write(tmp: Path, *a, **k) -> None:
        saves.append(tmp.name)
        if tmp.name in ("step_00000002.tmp", "step_00000003.tmp"):
            os.kill(os.getpid(), signal.SIGTERM)  # handled before the next line runs
        real(tmp, *a, **k)

    monkeypatch.setattr(ckpt, "write_rank_files", signalling_write)
    argv = train_argv(run, dataset, 6, "--train.checkpoint_every", "2", "--train.async_checkpoint", "false")
    assert main(argv) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert saves == ["step_00000002.tmp", "step_00000003.tmp"]
    lines = [line for line in err.splitlines() if "second stop signal" in line]
    assert len(lines) == 1 and f"newest complete checkpoint: {run / 'checkpoints' / 'step_00000002'};" in lines[0]
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_00000002"]  # the partial one is not complete
    monkeypatch.setattr(ckpt, "write_rank_files", real)
    assert main([*argv, "--resume"]) == 0
    assert "resuming at step 2" in capsys.readouterr().out
    assert logged_steps(run) == list(range(1, 7))


def test_stop_gives_up_the_background_save_in_flight(tmp_path, dataset, monkeypatch, capsys):  # noqa: F811
    """SIGTERM while step 2's checkpoint is written in the background: the stop's own save does not wait for that
    write (it would make a stop take two saves' time, past torchrun's grace) but gives it up between two pieces and
    removes its directory; the stop's checkpoint is complete and the run resumes from it."""
    import threading

    run = tmp_path / "run"
    real, seen = ckpt.write_safetensors, {}

    def held_write(path, tensors, **kwargs):
        if Path(path).parent.name == "step_00000002.tmp" and "cancelled" in kwargs:
            os.kill(os.getpid(), signal.SIGTERM)  # the stop is asked while this write goes on
            deadline = time.monotonic() + 120
            while not kwargs["cancelled"]() and time.monotonic() < deadline:
                time.sleep(0.01)  # a long write: still under way when the stop's save begins
            seen["cancelled"] = kwargs["cancelled"]()
            seen["thread"] = threading.current_thread().name
        return real(path, tensors, **kwargs)

    monkeypatch.setattr(ckpt, "write_safetensors", held_write)
    argv = train_argv(run, dataset, 8, "--train.checkpoint_every", "2", "--train.async_checkpoint", "true")
    assert main(argv) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert seen == {"cancelled": True, "thread": "fivefold-checkpoint-2"}
    stopped = ckpt.list_checkpoints(run)
    assert [p.name for p in stopped] in (["step_00000003"], ["step_00000004"]), stopped  # step 2's given up
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    ckpt.verify_files(stopped[0])
    assert f"stopped by SIGTERM after step {int(stopped[0].name[5:])}" in err
    monkeypatch.setattr(ckpt, "write_safetensors", real)
    assert main([*argv, "--resume"]) == 0
    assert logged_steps(run) == list(range(1, 9))


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits, undelivered, for the (stopped) process `pid`."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M)[1], 16)
    return bool(pending >> (signum - 1) & 1)


@pytest.mark.slow  # heavy; the fast run keeps the same feature's other tests
def test_second_signal_to_the_launcher_abandons_the_save(tmp_path):
    """The workers stopped (SIGSTOP) so that they are certainly still stopping: SIGTERM to the launcher, which
    PyTorch's agent forwards to them, then a second SIGTERM while the agent waits for them. The launcher kills them
    and says in one line that the save is abandoned, naming the newest complete checkpoint, which is unchanged."""
    run = tmp_path / "run"
    proc, workers = _start_training(run, 600.0, "--train.checkpoint_every", "2")
    # a complete checkpoint first: the step-2 save may still be in flight when the third step is logged
    deadline = time.monotonic() + 120
    while ckpt.latest_checkpoint(run) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was completed"
        time.sleep(0.1)
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.5)  # a save the stop caught in the middle stays as it is
        newest = ckpt.latest_checkpoint(run)
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not all(signal_pending(pid, signal.SIGTERM) for pid in workers):
            assert time.monotonic() < deadline, "the launcher did not forward SIGTERM"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    lines = [line for line in out.splitlines() if "second stop signal" in line]
    assert newest is not None and len(lines) == 1, out[-3000:]
    assert f"newest complete checkpoint: {newest}; continue with `fivefold train --resume --run-dir {run} --nproc 2`" \
        in lines[0]
    assert ckpt.latest_checkpoint(run) == newest and "Traceback" not in out
    assert not any(_alive(pid) for pid in workers) and not (run / RUN_LOCK).exists()


def test_the_agents_stop_announcements_are_dropped_and_its_other_lines_kept(tmp_path, caplog):
    """PyTorch's own process context stops a child with SIGINT: it announces "Sending process N closing signal
    SIGINT" (the reference: the same stop outside `quiet_agent_stops`), which the launcher drops while it runs the
    workers; the logger's other warnings still pass, and nothing is dropped after."""
    import logging

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from fivefold.launch import quiet_agent_stops

    name = "torch.distributed.elastic.multiprocessing.api"

    def stop_a_child(quiet: bool) -> list[str]:
        caplog.clear()
        context = start_processes("sleeper", "sleep", {0: ("60",)}, {0: {}},
                                  DefaultLogsSpecs(log_dir=str(tmp_path / f"logs-{quiet}")))
        with quiet_agent_stops() if quiet else contextlib.nullcontext():
            context.close(signal.SIGINT, timeout=30)
            logging.getLogger(name).warning("another warning of the agent")
        return [r.getMessage() for r in caplog.records if r.name == name]

    with caplog.at_level(logging.WARNING, logger=name):
        loud = stop_a_child(False)
        quiet = stop_a_child(True)
        after = stop_a_child(False)
    assert len(loud) == 2 and re.fullmatch(r"Sending process \d+ closing signal SIGINT", loud[0]), loud
    assert quiet == ["another warning of the agent"]
    assert len(after) == 2 and "closing signal SIGINT" in after[0]


@pytest.mark.slow  # about 40 s on the 2-core machine: two workers start and train before the stop
def test_ctrl_c_of_two_processes_ends_with_fivefold_lines_only(tmp_path):
    """Ctrl-C, as a terminal sends it (SIGINT to the launcher and its workers, one process group): exit 130, a
    checkpoint of the step it was in, and the end of the output is fivefold's own lines (what was saved, how to
    resume; the processes stopped), without PyTorch's agent announcing the signal it forwards."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fivefold", "train", "--nproc", "2", "--layout.dp", "2", "--max-steps", "100000",
         "--run-dir", str(run), "--log.progress", "plain", "--log.log_every", "1", "--train.eval_every", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(SRC)},
        start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").is_file() and logged_steps(run)):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "closing signal" not in out and "death signal" not in out, out[-3000:]
    assert not re.search(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d", out, re.M), out[-3000:]  # no line of torch's logging
    step = stopped_step(out, "SIGINT")
    assert ckpt.latest_checkpoint(run).name == f"step_{step:08d}"
    ckpt.verify_files(ckpt.latest_checkpoint(run))
    lines = out.strip().splitlines()
    said = next(i for i, line in enumerate(lines) if f"stopped by SIGINT after step {step}" in line)
    assert f"continue with `fivefold train --resume --run-dir {run} --nproc 2`" in lines[said]
    assert lines[-1] == "fivefold: stopped by SIGINT; the 2 processes were stopped"
    assert all(line.startswith(("summary:", "plan vs measured")) for line in lines[said + 1:-1]), lines[said:]
    assert "Traceback" not in out and not (run / RUN_LOCK).exists()
