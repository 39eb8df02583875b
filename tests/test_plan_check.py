"""A run checked against its plan (`fivefold.train.expect`): the comparison on made-up intervals whose answer is
known, and real 2-process runs on the CPU, one with a rank slowed on purpose (a sleep before each step's forward,
the test-only `FIVEFOLD_TEST_SLOW_RANK` hook), which must name that rank, and one without, which must not."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fivefold.accelerators import HARDWARE
from fivefold.config import ConfigError, build_config
from fivefold.planner.hardware import get_cluster
from fivefold.planner.predict import device_cluster, estimate_run
from fivefold.train.expect import SLOW_RANK_ENV, Expectation, Interval, PlanCheck, WaitClock, injected_delay
from fivefold.train.preflight import warnings

SRC = str(Path(__file__).resolve().parents[1] / "src")
GIB = 2**30


def expected(step_s: float = 1.0, peak: float = 10 * GIB) -> Expectation:
    return Expectation("h100", step_s, peak, {"parameters": 2 * GIB, "gradients": 2 * GIB, "optimizer": 4 * GIB,
                                               "activations": 2 * GIB})


def interval(seconds: list[float], waited: list[float], peak: int = 9 * GIB, steps: int = 10) -> Interval:
    return Interval(steps, seconds, waited, [peak] * len(seconds))


def test_the_rank_its_peers_wait_for_is_named_once() -> None:
    check = PlanCheck(expected(), "cuda")
    # the first interval holds the warm-up: measured, not judged
    assert check.observe(interval([30.0] * 4, [0.0, 20.0, 20.0, 20.0])) == []
    # rank 2 is busy the whole 1 s step; its three peers wait 0.4 s of it for rank 2
    lines = check.observe(interval([10.0] * 4, [4.0, 4.0, 0.1, 4.0]))
    assert len(lines) == 1 and lines[0].startswith("rank 2 is slower than the others")
    assert "0.99 s per step against a median 0.6 s of the others, which wait 0.4 s per step" in lines[0]
    assert check.observe(interval([10.0] * 4, [4.0, 4.0, 0.1, 4.0])) == []  # said once
    assert check.summary().startswith("plan vs measured (h100 profile): step 1 s predicted, 1 s measured (+0 %)")


def test_balanced_ranks_and_small_differences_say_nothing() -> None:
    check = PlanCheck(expected(), "cuda")
    check.observe(interval([10.0] * 4, [0.0] * 4))
    assert check.observe(interval([10.0] * 4, [0.5, 0.4, 0.6, 0.5])) == []  # 5 % waits, alike
    # one rank 37 % busier than the other, by a ninth of the step (seen in a normal run on a loaded machine): noise
    noisy = PlanCheck(expected(step_s=0.4), "cpu")
    noisy.observe(interval([4.0] * 2, [0.0] * 2))
    assert noisy.observe(interval([0.435] * 2, [0.121, 0.006], steps=1)) == []
    # one rank twice as busy as the other, but by less than a fifth of the step: noise
    short = PlanCheck(expected(step_s=1.0), "cuda")
    short.observe(interval([10.0] * 2, [0.0] * 2))
    assert short.observe(interval([1.0] * 2, [0.9, 0.8], steps=1)) == []


def test_every_rank_slow_alike_blames_the_device_profile() -> None:
    check = PlanCheck(expected(step_s=1.0), "cuda")
    check.observe(interval([10.0] * 2, [0.0] * 2))
    lines = check.observe(interval([20.0] * 2, [0.1, 0.1]))
    assert len(lines) == 1 and "every rank slower alike" in lines[0] and "+100 %" in lines[0]
    assert "h100 profile does not describe this machine" in lines[0]
    check = PlanCheck(expected(step_s=1.0), "cuda")
    check.observe(interval([10.0] * 2, [0.0] * 2))
    assert "every rank faster alike" in check.observe(interval([5.0] * 2, [0.0] * 2))[0]
    inside = PlanCheck(expected(step_s=1.0), "cuda")
    inside.observe(interval([10.0] * 2, [0.0] * 2))
    assert inside.observe(interval([13.0] * 2, [0.0] * 2)) == []  # +30 %: inside the band


def test_memory_above_the_prediction_names_the_part() -> None:
    # 14 GiB against 10 predicted, model states as predicted (8 GiB): the activations are over
    check = PlanCheck(expected(), "cuda", held_states=8 * GIB)
    check.observe(interval([10.0] * 2, [0.0] * 2, peak=14 * GIB))
    lines = check.observe(interval([10.0] * 2, [0.0] * 2, peak=14 * GIB))
    assert len(lines) == 1 and "peak memory 14.00 GiB measured against 10.00 GiB predicted (+40 %)" in lines[0]
    assert "activations and buffers: 6.00 GiB against 2.00 GiB predicted" in lines[0]
    # the states hold 12 GiB against 8 predicted: they are the excess
    check = PlanCheck(expected(), "cuda", held_states=12 * GIB)
    check.observe(interval([10.0] * 2, [0.0] * 2, peak=14 * GIB))
    assert "the model states: 12.00 GiB held against 8.00 GiB predicted" in check.observe(
        interval([10.0] * 2, [0.0] * 2, peak=14 * GIB))[0]
    # on the CPU the resident set above each rank's baseline (the interpreter, its libraries, the data) is compared,
    # and the C allocator's cache of freed memory (measured up to 2.4x on one process) says nothing
    def cpu_run(peaks: list[float], baselines: list[float]) -> tuple[PlanCheck, list[str]]:
        check = PlanCheck(expected(peak=0.2 * GIB), "cpu", held_states=0)
        for _ in range(2):  # the first interval is not judged
            lines = check.observe(Interval(10, [10.0] * 2, [0.0] * 2, [int(p * GIB) for p in peaks],
                                           [int(b * GIB) for b in baselines]))
        return check, lines

    quiet, said = cpu_run([0.7, 0.65], [0.3, 0.35])  # 0.4 GiB above the baseline, 2x the prediction
    assert said == []
    assert quiet.summary().endswith("peak 0.20 GiB predicted, 0.40 GiB measured above the process's 0.30 GiB before "
                                    "the model was built")
    # rank 1 holds 1.3 GiB above its own baseline: 6.5x the prediction and past the margin, whatever rank 0 holds
    _, said = cpu_run([0.7, 1.6], [0.3, 0.3])
    assert len(said) == 1 and "peak memory 1.30 GiB measured above the process's 0.30 GiB before the model " \
        "was built against 0.20 GiB predicted (+550 %)" in said[0]
    assert "the C allocator also keeps freed memory" in said[0]


def test_the_wait_clock_counts_host_waits_on_the_cpu() -> None:
    clock = WaitClock(torch.device("cpu"))
    with clock():
        time.sleep(0.05)
    assert 0.04 < clock.read() < 1.0 and clock.read() == 0.0  # read resets
    off = WaitClock(torch.device("cpu"), enabled=False)
    with off():
        time.sleep(0.02)
    assert off.read() == 0.0


def test_the_slow_rank_hook_reads_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SLOW_RANK_ENV, "1:0.25")
    assert (injected_delay(0), injected_delay(1)) == (0.0, 0.25)
    monkeypatch.delenv(SLOW_RANK_ENV)
    assert injected_delay(1) == 0.0


def test_a_run_predicted_to_take_over_an_hour_says_so_before_it_starts() -> None:
    def said(preset: str | None, overrides: dict[str, str]) -> list[str]:
        cfg = build_config(None, overrides, preset)
        return warnings(cfg, torch.device("cpu"), estimate_run(cfg, get_cluster("cpu"), "cpu").step_time_s)

    # the README's own-data example on 2 cores: smollm-135m for 1,000 steps; and a 1.2B preset by a typo
    for preset, steps in (("smollm-135m", "1000"), ("llama-3.2-1b", "450")):
        lines = said(preset, {"train.max_steps": steps})
        assert any(w.startswith("this run is predicted to take ~") and f"train.max_steps = {steps}" in w
                   for w in lines), (preset, lines)
    assert said(None, {}) == []  # the default run: about two minutes, nothing to say


def _train(run_dir: Path, slow: str | None, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop(SLOW_RANK_ENV, None)
    if slow:
        env[SLOW_RANK_ENV] = slow
    done = subprocess.run(
        [sys.executable, "-m", "fivefold", "train", "--nproc", "2", "--layout.dp", "2", "--max-steps", "8",
         "--log.log_every", "4", "--train.eval_batches", "1", "--run-dir", str(run_dir), *extra],
        capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_a_slowed_rank_is_named_and_a_normal_run_gets_no_such_warning(tmp_path: Path) -> None:
    slowed = _train(tmp_path / "slow", "1:0.8")
    assert "warning: rank 1 is slower than the others" in slowed, slowed
    assert "plan (cpu profile): step" in slowed and "plan vs measured (cpu profile)" in slowed
    # a profile of this machine (`fivefold train --hardware`, as `fivefold calibrate --out` writes one) reaches the
    # started processes' plan check: rank 0 names it
    normal = _train(tmp_path / "normal", None, "--hardware", str(profile(tmp_path, "this-cpu")))
    assert "is slower than the others" not in normal, normal
    assert "plan vs measured (this-cpu profile)" in normal, normal


def profile(where: Path, name: str, base: str = "cpu", fields: str = "") -> Path:
    """A hardware profile file as `fivefold calibrate --out` writes one: a preset with fields of its own."""
    path = where / f"{name}.toml"
    path.write_text(f'name = "{name}"\nbase = "{base}"\n{fields}\n')
    return path


def test_train_checks_a_run_against_a_profile_of_its_device(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from fivefold.cli import main
    from fivefold.cli.train import forwarded_argv, plan_expectation

    quarter = HARDWARE["cpu"].fp32_tflops / 4  # the cpu preset's matmuls 4x slower
    slow = profile(tmp_path, "slow-cpu", fields=f"fp32_tflops = {quarter}\nbf16_tflops = {quarter}")
    cfg = build_config(None, {"train.device": "cpu"})
    default, measured = (estimate_run(cfg, get_cluster(*where), "cpu").step_time_s
                         for where in (("cpu",), (None, slow)))
    assert measured > 1.5 * default  # the profile's own figure, not the built-in one
    assert main(["train", "--dry-run", "--train.device", "cpu", "--hardware", str(slow)]) == 0
    said = capsys.readouterr().out
    ram = device_cluster(torch.device("cpu"), 1, str(slow)).memory_gib  # this machine's, as the start checks it
    assert f"planner (slow-cpu, fivefold-cpu engine): fits, peak 0.2 GiB of {ram:,.1f} GiB per device; step " \
        f"{measured:.2f} s" in said
    # what rank 0 of a started job checks the run against, and what the launcher hands each process
    expected = plan_expectation(cfg, 1, str(slow))
    assert expected is not None and expected.profile == "slow-cpu"
    assert expected.step_s == pytest.approx(measured, rel=1e-9)
    args = argparse.Namespace(config=None, preset=None, data=None, max_steps=None, hf=None, resume=False,
                              profile=False, hardware="slow-cpu.toml", overrides=[])
    assert forwarded_argv(args, "runs/x")[-2:] == ["--hardware", str(Path("slow-cpu.toml").resolve())]


@pytest.mark.parametrize("extra, message", [
    (["--gpu", "h100", "--dry-run"], "--gpu 'h100' and --hardware"),
    (["--dry-run"], "describes an accelerator (h100-file), but the run uses train.device = 'cpu'"),
    ([], "describes an accelerator (h100-file), but the run uses train.device = 'cpu'"),
])
def test_train_refuses_a_profile_that_does_not_describe_its_device(extra: list[str], message: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from fivefold.cli import main

    gpu = profile(tmp_path, "h100-file", base="h100")
    assert main(["train", "--train.device", "cpu", "--hardware", str(gpu), *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_dry_run_judges_the_fit_by_this_machines_memory_as_the_start_does(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU the start-up check (`check_fits`) compares the prediction with this machine's RAM shared by the run's
    processes; the dry run said "of 16.0 GiB" (the nominal profile's) whatever the machine held, so the README's
    own-data example (23.5 GiB by the planner) was "does NOT fit" (exit 1) on a machine of 64 GiB where it starts.
    `--gpu` names another device, and `--slurm` other machines: those keep the profile's figure."""
    from fivefold.cli import main
    from fivefold.planner import predict

    monkeypatch.setattr(predict, "device_memory_bytes", lambda device, ranks: 64 * GIB // ranks)
    own = ["train", "--dry-run", "--train.device", "cpu", "--preset", "smollm-135m", "--train.seq_len", "512"]
    assert main(own) == 0
    assert "fits, peak 23.5 GiB of 64.0 GiB per device" in capsys.readouterr().out
    # two processes share the RAM: 32 GiB each, as `--nproc 2` would check them
    assert main([*own, "--nproc", "2", "--layout.dp", "2", "--train.global_batch_size", "64"]) == 0
    assert "fits, peak 23.5 GiB of 32.0 GiB per device" in capsys.readouterr().out
    assert main([*own, "--gpu", "cpu"]) == 1  # another device named: the profile's own 16.0 GiB
    assert "does NOT fit, peak 23.5 GiB of 16.0 GiB per device" in capsys.readouterr().out
    monkeypatch.setattr(predict, "device_memory_bytes", lambda device, ranks: 16 * GIB // ranks)
    assert main(own) == 1
    assert "does NOT fit, peak 23.5 GiB of 16.0 GiB per device" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="the planner predicts a peak of 23.5 GiB"):  # the start refuses it alike
        predict.check_fits(build_config(None, {"train.device": "cpu", "train.seq_len": "512"}, "smollm-135m"),
                           predict.device_cluster(torch.device("cpu"), 1), "cpu")


def test_a_slurm_script_takes_a_profile_of_the_compute_nodes(tmp_path: Path) -> None:
    """Written here, run on the cluster's nodes: with train.device = auto their device decides, not this machine's."""
    from fivefold.cli import main

    gpu, script = profile(tmp_path, "h100-file", base="h100"), tmp_path / "train.sbatch"
    assert main(["train", "--slurm", str(script), "--hardware", str(gpu), "--nproc", "2", "--layout.dp", "2"]) == 0
    assert f"--hardware {gpu.resolve()}" in script.read_text()


def test_train_refuses_a_missing_or_broken_profile_by_name(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from fivefold.cli import main

    assert main(["train", "--dry-run", "--train.device", "cpu", "--hardware", str(tmp_path / "none.toml")]) == 2
    assert "none.toml" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text('base = "cpu"\ncompute_scale = -1\n')
    assert main(["train", "--dry-run", "--train.device", "cpu", "--hardware", str(broken)]) == 2
    assert "compute_scale" in capsys.readouterr().err


def test_the_dry_run_says_how_long_in_a_unit_that_reads(capsys: pytest.CaptureFixture[str]) -> None:
    from fivefold.cli import main
    from fivefold.train.preflight import rough_duration

    assert [rough_duration(s) for s in (42, 125, 21_000, 4 * 86400)] == ["42 s", "2 min", "5.8 h", "4 days"]
    # the default run takes minutes; it read "about 0.0 h" when every duration was printed in hours
    assert main(["train", "--dry-run", "--train.device", "cpu"]) == 0
    assert re.search(r"450 steps take about \d+ min\n", capsys.readouterr().out)


def test_a_cpu_profile_measured_with_other_threads_than_the_run_is_said(tmp_path: Path) -> None:
    from fivefold.cli.train import profile_threads
    from fivefold.train.loop import default_threads

    own = default_threads(1)
    path = profile(tmp_path, "mine", fields=f"cores = 2\nthreads_per_rank = {own + 1}\n[ranks.2]\nthreads_per_rank = 1")
    hw = get_cluster(None, path)
    said = profile_threads(build_config(None, {}), hw, 1)
    assert said is not None and f"measured with {own + 1} intra-op thread(s) per rank with 1 rank(s)" in said
    assert f"this run uses {own} (train.threads = 0" in said and f"--threads {own}" in said
    assert profile_threads(build_config(None, {"train.threads": str(own + 1)}), hw, 1) is None
    # two processes read the [ranks.2] table: one thread each there, as the run sets
    assert profile_threads(build_config(None, {"train.threads": "1"}), hw, 2) is None
    assert profile_threads(build_config(None, {"train.threads": "2"}), hw, 2) is not None
    assert profile_threads(build_config(None, {}), get_cluster("cpu"), 1) is None  # the built-in: no threads stated
