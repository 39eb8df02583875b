"""`fivefold export` and `generate` accept exactly the checkpoints a resume accepts: a checkpoint without its
`COMPLETE` marker, with any file the manifest lists missing, cut or changed, a `.tmp` left by a killed save or a
`.bad` set aside by a resume is refused with one line naming the file and the problem; a run directory gives its
newest good checkpoint and says which newer one it skipped and why. A resume refuses another training corpus
(compared by its fingerprint, so the same prepared directory moved elsewhere resumes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

from fivefold.cli import main
from fivefold.data import prepare_dataset
from fivefold.train import checkpoint as ckpt
from fivefold.train.loop import train

EVERY_2 = {"train.checkpoint_every": "2", "train.keep_checkpoints": "5", "train.threads": "1"}
STEP_2, STEP_4 = "step_00000002", "step_00000004"


@pytest.fixture(scope="module")
def run_and_exports(tmp_path_factory, dataset) -> tuple[Path, dict[str, dict]]:  # noqa: F811
    """A run with intact checkpoints at steps 2 and 4, and the model tensors exported from each (the reference a
    damaged run's export is compared with)."""
    root = tmp_path_factory.mktemp("readers")
    train(small_config(root / "run", dataset, **EVERY_2), stop_after=4)
    weights = {}
    for step in (STEP_2, STEP_4):
        assert main(["export", "--checkpoint", str(root / "run" / "checkpoints" / step),
                     "--hf", str(root / step)]) == 0
        weights[step] = load_file(str(root / step / "model.safetensors"))
    assert any(not weights[STEP_2][k].equal(weights[STEP_4][k]) for k in weights[STEP_2])  # the steps differ
    return root / "run", weights


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, size unchanged: only the checksum can tell
    path.write_bytes(bytes(data))


DAMAGE = {  # name -> (file of step 4, what is done to it, the problem the message must name)
    "no COMPLETE": ("COMPLETE", lambda p: p.unlink(), "not a complete checkpoint (no COMPLETE marker"),
    "index.json deleted": ("index.json", lambda p: p.unlink(), "index.json is missing"),
    "index.json flipped": ("index.json", flip, "index.json is corrupted: its sha256"),
    "index.json emptied": ("index.json", lambda p: p.write_bytes(b""), "index.json is corrupted: 0 bytes"),
    "trainer_state.json cut": ("trainer_state.json", lambda p: p.write_bytes(p.read_bytes()[:10]),
                               "trainer_state.json is corrupted: 10 bytes"),
    "trainer_state.json flipped": ("trainer_state.json", flip, "trainer_state.json is corrupted: its sha256"),
    "rng deleted": ("rng-rank0.safetensors", lambda p: p.unlink(), "rng-rank0.safetensors is missing"),
    "rng flipped": ("rng-rank0.safetensors", flip, "rng-rank0.safetensors is corrupted: its sha256"),
    # a rank's piece index: deleted (the marker is there), or a byte changed that still parses (the checksum, not
    # a parse error)
    "rank0.json deleted": ("rank0.json", lambda p: p.unlink(), "rank0.json is missing"),
    "rank0.json flipped": ("rank0.json", flip, "rank0.json is corrupted: its sha256"),
    "pieces flipped": ("rank0.safetensors", flip, "rank0.safetensors is corrupted: its sha256"),
}


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"fivefold {command}: error: "), err
    return err


@pytest.mark.parametrize("case", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_checkpoint_is_refused_and_the_run_falls_back(run_and_exports, tmp_path, capsys, case):
    run, weights = run_and_exports
    name, damage, problem = DAMAGE[case]
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest = copy / "checkpoints" / STEP_4
    damage(newest / name)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(newest), "--hf", str(tmp_path / "named")]) == 2
    err = one_line_error(capsys, "export")
    assert problem in err and "cannot be used" in err, err
    assert not (tmp_path / "named" / "model.safetensors").exists()
    assert main(["generate", "--checkpoint", str(newest), "--prompt", "A", "--max-new-tokens", "2"]) == 2
    assert problem in one_line_error(capsys, "generate")
    # the run directory gives the newest good checkpoint, step 2, and says why step 4 was skipped
    assert main(["export", "--checkpoint", str(copy), "--hf", str(tmp_path / "from_run")]) == 0
    out = capsys.readouterr().out
    assert f"using {STEP_2}" in out and f"skipped the newer {STEP_4} (" in out and problem in out, out
    got = load_file(str(tmp_path / "from_run" / "model.safetensors"))
    assert got.keys() == weights[STEP_2].keys() and all(got[k].equal(weights[STEP_2][k]) for k in got)


def test_resume_refuses_what_export_refuses(run_and_exports, tmp_path, dataset, capsys):  # noqa: F811
    """The same damage, seen by a resume: it sets step 4 aside naming the same file, and the `.bad` directory it
    leaves is refused by name."""
    run, _ = run_and_exports
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "checkpoints" / STEP_4 / "rng-rank0.safetensors").unlink()
    capsys.readouterr()
    train(small_config(copy, dataset, **{**EVERY_2, "train.max_steps": "5"}), resume=True)
    assert "rng-rank0.safetensors is missing" in capsys.readouterr().err
    bad = copy / "checkpoints" / f"{STEP_4}.bad"
    assert bad.is_dir()
    assert main(["export", "--checkpoint", str(bad), "--hf", str(tmp_path / "x")]) == 2
    assert "set aside" in one_line_error(capsys, "export")


def test_tmp_and_bad_directories_are_refused_by_name(run_and_exports, tmp_path, capsys):
    run, weights = run_and_exports
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    root = copy / "checkpoints"
    shutil.copytree(root / STEP_4, root / "step_00000006.tmp")  # every file, not renamed: a save killed at the end
    shutil.copytree(root / STEP_4, root / "step_00000008.bad")
    for name, why in (("step_00000006.tmp", "never finished"), ("step_00000008.bad", "set aside")):
        for command in (["export", "--hf", str(tmp_path / "x")], ["generate", "--max-new-tokens", "1"]):
            assert main([command[0], "--checkpoint", str(root / name), *command[1:]]) == 2
            assert why in one_line_error(capsys, command[0])
    # neither is a checkpoint of the run: the run directory gives step 4, skipping nothing
    assert main(["export", "--checkpoint", str(copy), "--hf", str(tmp_path / "from_run")]) == 0
    out = capsys.readouterr().out
    assert f"using {STEP_4}" in out and "skipped" not in out, out
    got = load_file(str(tmp_path / "from_run" / "model.safetensors"))
    assert all(got[k].equal(weights[STEP_4][k]) for k in got)


def test_a_run_whose_only_checkpoint_is_an_interrupted_save_is_refused_saying_what_a_resume_does(
        run_and_exports, tmp_path, dataset, capsys):  # noqa: F811
    """A run directory whose only step directory lacks its COMPLETE marker (a save that never finished): a resume
    refuses the run ("no usable checkpoint") and sets nothing aside (the reference), and export and generate say
    exactly that; moved out (or left as a `.tmp`), a resume starts the run again at step 0, as their line says."""
    run, _ = run_and_exports
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    root = copy / "checkpoints"
    shutil.rmtree(root / STEP_2)
    (root / STEP_4 / "COMPLETE").unlink()
    capsys.readouterr()
    with pytest.raises(ckpt.CheckpointError, match="no usable checkpoint: .*no COMPLETE marker"):
        train(small_config(copy, dataset, **{**EVERY_2, "train.max_steps": "6"}), resume=True)
    assert [p.name for p in root.iterdir()] == [STEP_4]  # nothing set aside
    for command in (["export", "--hf", str(tmp_path / "x")], ["generate", "--max-new-tokens", "1"]):
        assert main([command[0], "--checkpoint", str(copy), *command[1:]]) == 2
        err = one_line_error(capsys, command[0])
        assert "no COMPLETE marker" in err and "set each aside" not in err, err
        assert "`fivefold train --resume` refuses the run for the same reason (no usable checkpoint) and sets " \
               f"nothing aside; to train it again from step 0, move it out of '{root}'" in err, err
    # left as the .tmp directory of a killed save, it is no checkpoint: a resume starts the run again at step 0
    (root / STEP_4).rename(root / f"{STEP_4}.tmp")
    assert main(["export", "--checkpoint", str(copy), "--hf", str(tmp_path / "x")]) == 2
    err = one_line_error(capsys, "export")
    assert f"only {STEP_4}.tmp, which are not checkpoints; `fivefold train --resume` starts this run again at " \
           "step 0" in err, err
    train(small_config(copy, dataset, **{**EVERY_2, "train.max_steps": "2"}), resume=True)
    assert "starting it again at step 0" in capsys.readouterr().err
    assert (root / STEP_2 / "COMPLETE").is_file()


def test_a_missing_rank_of_a_two_rank_checkpoint_is_named(run_and_exports, tmp_path, capsys):
    """A checkpoint whose manifest lists a second rank's files (world_size = 2; built from the one-rank checkpoint,
    which a save's manifest vouches for): accepted whole, refused naming rank1.json when that rank's files go."""
    run, _ = run_and_exports
    step = tmp_path / STEP_4
    shutil.copytree(run / "checkpoints" / STEP_4, step)
    for name in ("rank0.json", "rank0.safetensors", "rng-rank0.safetensors"):
        shutil.copy(step / name, step / name.replace("rank0", "rank1"))
    state = json.loads((step / "trainer_state.json").read_text())
    (step / "trainer_state.json").write_text(json.dumps({**state, "world_size": 2}))
    ckpt.write_manifest(step)
    assert main(["export", "--checkpoint", str(step), "--hf", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    (step / "rank1.json").unlink()
    (step / "rank1.safetensors").unlink()
    assert main(["export", "--checkpoint", str(step), "--hf", str(tmp_path / "x")]) == 2
    err = one_line_error(capsys, "export")
    assert "rank1.json is missing" in err and "does not match the model config" not in err, err


def test_resume_refuses_another_corpus_and_takes_the_same_one_moved(tmp_path, dataset):  # noqa: F811
    full = train(small_config(tmp_path / "full", dataset, **EVERY_2))
    train(small_config(tmp_path / "cut", dataset, **EVERY_2), stop_after=4)
    # another corpus of the same tokenizer: the tokenizer check passes, the data position would index other text
    text = (dataset.parent / "plays.txt").read_text()
    (tmp_path / "other.txt").write_text(text[len(text) // 2:])
    other = prepare_dataset([tmp_path / "other.txt"], tmp_path / "other", tokenizer=dataset / "tokenizer.json",
                            val_fraction=0.1)
    with pytest.raises(ckpt.CheckpointError, match=rf"data.path = '{dataset}', this run has data.path = '{other}'"
                       r".*resume with data.path"):
        train(small_config(tmp_path / "cut", other, **EVERY_2), resume=True)
    # the same prepared directory, moved: the fingerprint matches, and the resume continues exactly
    moved = shutil.copytree(dataset, tmp_path / "moved")
    rest = train(small_config(tmp_path / "cut", moved, **EVERY_2), resume=True)
    assert rest.losses == full.losses[4:]


def _state(change):
    def edit(path: Path) -> None:
        state = json.loads(path.read_text())
        change(state)
        path.write_text(json.dumps(state))
    return edit


# files whose checksums are right (the manifest written again, as a hand edit would) but whose values no run writes:
# name -> (file of step 4, the change, the problem the message must name)
MEANINGLESS = {
    "seq_len text": ("trainer_state.json", _state(lambda s: s.update(seq_len="abc")), "'abc'"),
    "negative step": ("trainer_state.json", _state(lambda s: s.update(step=-7)), "step = -7 is negative"),
    "unknown lr phase": ("trainer_state.json", _state(lambda s: s.update(lr_phases=[[4, "bogus"]])),
                         "lr_phases kind 'bogus'"),
    "batch of 0": ("trainer_state.json", _state(lambda s: s.update(global_batch_size=0)),
                   "global_batch_size = 0 is below 1"),
    "infinite rope_theta": ("config.toml", lambda p: p.write_text(p.read_text().replace(
        "rope_theta = 10000.0", "rope_theta = inf")), "config.toml: model.rope_theta = inf must be a finite number"),
}


@pytest.mark.parametrize("case", list(MEANINGLESS), ids=list(MEANINGLESS))
def test_meaningless_values_behind_right_checksums_are_refused(run_and_exports, tmp_path, dataset,  # noqa: F811
                                                                capsys, case):
    """A resume ended in a traceback (int('abc'), an unknown phase's IndexError) or a sampler's message naming no file
    (start_step -7), and generate sampled from a model of infinite rope_theta: each is refused in one line naming
    the file, by export, generate and a resume alike."""
    run, _ = run_and_exports
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest = copy / "checkpoints" / STEP_4
    name, change, problem = MEANINGLESS[case]
    change(newest / name)
    ckpt.write_manifest(newest)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(newest), "--hf", str(tmp_path / "x")]) == 2
    err = one_line_error(capsys, "export")
    assert problem in err and name in err, err
    assert main(["generate", "--checkpoint", str(newest), "--prompt", "A", "--max-new-tokens", "2"]) == 2
    err = one_line_error(capsys, "generate")
    assert problem in err and name in err, err
    if name == "trainer_state.json":  # a resume sets it aside, naming it, and goes on from step 2
        train(small_config(copy, dataset, **{**EVERY_2, "train.max_steps": "5"}), resume=True)
        err = capsys.readouterr().err
        assert f"{STEP_4} cannot be used" in err and problem in err, err
        assert (copy / "checkpoints" / f"{STEP_4}.bad").is_dir()


@pytest.mark.parametrize(("change", "said"), [
    (["--train.seq_len", "16"], "written with train.seq_len = 32, this run has 16"),
    (["--train.seed", "7"], "written with train.seed = 1234, this run has 7"),
    (["--model.hidden", "128"], "model.hidden = 128 (the checkpoint's: 64)"),
    (["--max-steps", "2"], "is at step 4, which is not before train.max_steps = 2"),
], ids=["seq_len", "seed", "model", "max_steps"])
def test_resume_refusals_come_before_data_and_engine(run_and_exports, tmp_path, monkeypatch, capsys, change, said):
    """What a checkpoint's small files decide (another seq_len, seed or model; a max_steps every checkpoint has
    reached) is refused by the command line before any process starts, any data is read or any engine is built
    (a 70B engine takes minutes), as the resume itself refuses it once the checkpoint is loaded."""
    from fivefold.train import loop

    run, _ = run_and_exports
    copy = tmp_path / "run"
    shutil.copytree(run, copy)

    def no_engine(*_args, **_kwargs):
        raise AssertionError("the engine was built before the refusal")

    monkeypatch.setattr(loop, "build_engine", no_engine)
    monkeypatch.setattr(loop, "load_data", no_engine)
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(copy), *change]) == 2
    assert said in one_line_error(capsys, "train")
    assert main(["train", "--resume", "--run-dir", str(copy), "--dry-run", *change]) == 2  # and --dry-run says so
    assert said in one_line_error(capsys, "train")
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == [STEP_2, STEP_4]  # nothing set aside


def test_a_newest_checkpoint_damaged_inside_still_falls_back_past_max_steps(run_and_exports, tmp_path, capsys):
    """The early check refuses train.max_steps only where every checkpoint has reached it: a newest checkpoint whose
    damage shows only when its weights are read (a flipped bit in a piece file) is set aside by the resume, which
    goes on from the older one, as before."""
    run, _ = run_and_exports
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    flip(copy / "checkpoints" / STEP_4 / "rank0.safetensors")
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(copy), "--max-steps", "4"]) == 0
    assert f"resuming from the newest good checkpoint, {STEP_2}" in capsys.readouterr().err


def test_dry_run_refuses_a_run_directory_that_holds_another_run(run_and_exports, capsys):
    """As the run itself would at its start (the directory is read, nothing written)."""
    run, _ = run_and_exports
    capsys.readouterr()
    assert main(["train", "--dry-run", "--run-dir", str(run)]) == 2
    assert "already holds another run" in one_line_error(capsys, "train")
