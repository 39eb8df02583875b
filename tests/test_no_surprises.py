"""Nothing surprising on resume or export. A finished run extended with `--resume --max-steps N`: the learning rate
follows `train.lr_on_extension`, checked against the closed form of each choice (hold: the cosine schedule's final
rate lr x min_lr_ratio; decay: a cosine from it to min_lr_ratio times it over the new steps; stretch: the rates of a
run planned for N steps from the start), the choice said at the start, and the same rates after a kill in the middle
of the extension. Exports and checkpoints get the modes that the umask gives, so a team can share them."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

from fivefold.cli import main
from fivefold.train.loop import train

LR, RATIO = 3e-3, 0.1  # TrainConfig's defaults, which small_config keeps
FIRST, EXTENDED = 6, 10


def logged_lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "lr" in r}


def expected(how: str, step: int) -> float:
    """The closed form of the rate of (1-based) step `step` > FIRST after extending a cosine run of FIRST steps."""
    final = LR * RATIO  # a cosine schedule ends at lr x min_lr_ratio
    if how == "hold":
        return final
    progress = (step - 1 - FIRST) / (EXTENDED - FIRST)
    floor = final * RATIO
    return floor + (final - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def extend(tmp_path: Path, data: Path, capsys, stop_after: int | None = None, **choice: str) -> Path:
    run = tmp_path / "run"
    train(small_config(run, data, **{"train.checkpoint_every": "1"}))
    capsys.readouterr()
    train(small_config(run, data, **{"train.max_steps": str(EXTENDED), "train.checkpoint_every": "1", **choice}),
          resume=True, stop_after=stop_after, stream=None)
    return run


@pytest.mark.parametrize("how", ["default", "decay"])
def test_extension_follows_the_named_choice_and_the_default_holds(tmp_path, dataset, capsys, how):  # noqa: F811
    choice = {} if how == "default" else {"train.lr_on_extension": how}
    run = extend(tmp_path, dataset, capsys, **choice)
    how = "hold" if how == "default" else how
    out = capsys.readouterr().out
    assert f"train.max_steps {FIRST} -> {EXTENDED} extends the run; train.lr_on_extension = {how}" in out, out
    lrs = logged_lrs(run)
    # the first run's last step: warm-up 2 steps, then three quarters of its cosine
    assert lrs[FIRST] == pytest.approx(LR * RATIO + LR * (1 - RATIO) * 0.5 * (1 + math.cos(0.75 * math.pi)))
    for step in range(FIRST + 1, EXTENDED + 1):
        assert lrs[step] == pytest.approx(expected(how, step), rel=1e-9), (step, lrs)


def test_stretch_is_the_schedule_of_a_run_planned_for_the_new_total(tmp_path, dataset, capsys):  # noqa: F811
    run = extend(tmp_path, dataset, capsys, **{"train.lr_on_extension": "stretch"})
    reference = tmp_path / "planned"
    train(small_config(reference, dataset, **{"train.max_steps": str(EXTENDED)}))
    want = logged_lrs(reference)
    assert max(want.values()) > 3 * LR * RATIO  # the rate goes back up: why it is not the default
    assert {s: logged_lrs(run)[s] for s in range(FIRST + 1, EXTENDED + 1)} == {
        s: want[s] for s in range(FIRST + 1, EXTENDED + 1)}


def test_extension_killed_half_way_resumes_on_the_same_rates(tmp_path, dataset, capsys):  # noqa: F811
    """The checkpoints record the schedule's phases: a resume inside the extension (train.max_steps unchanged from
    the checkpoint's config) continues the decay, not a schedule planned over EXTENDED steps."""
    run = extend(tmp_path, dataset, capsys, stop_after=FIRST + 2, **{"train.lr_on_extension": "decay"})
    train(small_config(run, dataset, **{"train.max_steps": str(EXTENDED), "train.lr_on_extension": "decay"}),
          resume=True)
    lrs = logged_lrs(run)
    for step in range(FIRST + 1, EXTENDED + 1):
        assert lrs[step] == pytest.approx(expected("decay", step), rel=1e-9), (step, lrs)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_and_checkpoints_honour_the_umask(tmp_path, dataset, umask):  # noqa: F811
    run, out = tmp_path / "run", tmp_path / "exported"
    before = os.umask(umask)
    try:
        train(small_config(run, dataset, **{"train.max_steps": "2", "train.checkpoint_every": "2"}))
        assert main(["export", "--checkpoint", str(run), "--hf", str(out)]) == 0
    finally:
        os.umask(before)
    written = [out, *out.rglob("*"), *run.rglob("*")]
    assert (out / "model.safetensors").is_file() and (run / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o777 if path.is_dir() else 0o666) & ~umask, (str(path), oct(mode))
    readable = all(stat.S_IMODE(p.stat().st_mode) & stat.S_IROTH for p in written)
    assert readable == (umask == 0o022)  # group and others read under 022, nobody else under 077


def test_a_shortened_run_says_how_its_learning_rate_changes(tmp_path, dataset, capsys):  # noqa: F811
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "10", "train.checkpoint_every": "1"}), stop_after=4)
    capsys.readouterr()
    train(small_config(run, dataset, **{"train.max_steps": "6", "train.checkpoint_every": "1"}), resume=True,
          stream=None)
    out = capsys.readouterr().out
    assert "learning rate: train.max_steps 10 -> 6 shortens the run" in out, out
    assert "resume with --max-steps 10 to keep the planned rates" in out
