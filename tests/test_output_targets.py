"""Where a command writes, checked before its work: every flag that names an output file or folder is refused in one
line that names the flag and the path when the path is empty, sits under a regular file, under a directory that does
not exist (files), or where nothing can be written; and what a user put in a run directory or a checkpoint is never
replaced or deleted. Each case is the command line a user would type; none may end in a traceback."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from tests.test_train import dataset, small_config  # noqa: F401  (dataset is a fixture)

from fivefold.cli import main
from fivefold.train.checkpoint import list_checkpoints, prune_checkpoints
from fivefold.train.loop import RunDirError, train

SWEEP = """name = "t"
steps = 1
warmup = 0
[model]
preset = "tiny"
[train]
seq_len = 32
global_batch_size = 4
device = "cpu"
[[grid]]
devices = 1
layout = { micro_batch_size = [4] }
"""

def refused(capsys, argv: list[str], *said: str) -> str:
    """`fivefold ARGV` exits 2 with one error line holding each of `said`, and no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err, err
    for text in said:
        assert text in err, (argv, text, err)
    return err


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "userfile").write_text("a user's notes\n")
    (tmp_path / "corpus.txt").write_text("some text to tokenize. " * 50)
    (tmp_path / "grid.toml").write_text(SWEEP)
    return {"file": "userfile/sub", "missing": "nodir/out.json", "empty": ""}


@pytest.mark.parametrize("where", ["file", "missing", "empty"])
def test_output_files_are_checked_before_the_work(capsys, places, where):
    target = places[where]
    for flag, argv in (
        ("--out", ["bench", "--model", "tiny", "--seq-len", "16", "--steps", "1", "--warmup", "0", "--out", target]),
        ("--trace", ["bench", "--model", "tiny", "--seq-len", "16", "--steps", "1", "--warmup", "0", "--profile",
                     "1", "--trace", target]),
        ("--slurm", ["train", "--slurm", target, "--nodes", "2", "--nproc", "1", "--layout.dp", "2"]),
        ("--write-config", ["plan", "--model", "tiny", "--gpu", "h100", "--global-batch", "1024", "--seq-len", "128",
                            "--write-config", target]),
        ("--results", ["sweep", "grid.toml", "--results", target]),
        ("--out", ["calibrate", "--quick", "--device", "cpu", "--out", target]),
    ):
        err = refused(capsys, argv, flag)
        assert target in err or "empty" in err, err
    assert Path("userfile").read_text() == "a user's notes\n"


@pytest.mark.parametrize("where", ["file", "empty"])
def test_output_folders_are_checked_before_the_work(capsys, places, where):
    target = places[where]
    store = Path("ok.db")
    sqlite3.connect(store).close()
    for flag, argv in (
        ("--out", ["data", "prepare", "corpus.txt", "--out", target]),
        ("--out", ["report", str(store), "--out", target]),
        ("--runs", ["sweep", "grid.toml", "--results", "new.db", "--runs", target]),
        ("--slurm", ["sweep", "grid.toml", "--results", "new2.db", "--slurm", target]),
        ("--hf", ["export", "--checkpoint", "nothing", "--hf", target]),
    ):
        refused(capsys, argv, flag)
    assert not Path("new.db").exists() and not Path("new2.db").exists()  # the store was not begun
    assert Path("userfile").read_text() == "a user's notes\n"


def test_data_prepare_refuses_the_current_directory_up_front(capsys, places):
    Path("here").mkdir()
    Path("corpus.txt").rename("here/corpus.txt")
    import os
    os.chdir("here")
    refused(capsys, ["data", "prepare", "corpus.txt", "--out", "."], "--out .", "current directory")
    assert sorted(p.name for p in Path(".").iterdir()) == ["corpus.txt"]


def test_a_foreign_runs_table_is_not_a_results_store(capsys, places):
    db = sqlite3.connect("mlflow.db")
    db.execute("CREATE TABLE runs(key TEXT, status TEXT)")
    db.commit()
    db.close()
    refused(capsys, ["report", "mlflow.db", "--out", "rep"], "mlflow.db", "not a fivefold results store")
    refused(capsys, ["sweep", "grid.toml", "--results", "mlflow.db"], "mlflow.db", "not a fivefold results store")


def test_a_cache_that_cannot_be_written_is_named(capsys, places, monkeypatch, tmp_path):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path / "userfile"))
    refused(capsys, ["train", "--max-steps", "1", "--run-dir", "run", "--train.seq_len", "16",
                     "--train.global_batch_size", "2"], "FIVEFOLD_CACHE", "is a file")


def test_a_users_config_in_the_run_directory_is_never_replaced(tmp_path, dataset):  # noqa: F811
    run = tmp_path / "myexp"
    run.mkdir()
    mine = "# my experiment, lr tuned by hand\n[train]\nlr = 0.001\n"
    (run / "config.toml").write_text(mine)
    with pytest.raises(RunDirError, match="holds files but no run"):
        train(small_config(run, dataset, **{"train.max_steps": "1"}))
    with pytest.raises(RunDirError, match="not a run that fivefold started"):
        train(small_config(run, dataset, **{"train.max_steps": "1"}), resume=True)
    assert (run / "config.toml").read_text() == mine and sorted(p.name for p in run.iterdir()) == ["config.toml"]


def test_pruning_keeps_a_checkpoint_that_holds_a_users_file(tmp_path, dataset, capsys):  # noqa: F811
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "2", "train.checkpoint_every": "1",
                                        "train.keep_checkpoints": "2"}))
    first, second = list_checkpoints(run)
    (first / "my_eval.json").write_text("{}")
    capsys.readouterr()
    prune_checkpoints(run, keep=1)
    assert list_checkpoints(run) == [first, second] and (first / "my_eval.json").read_text() == "{}"
    assert "my_eval.json" in capsys.readouterr().err
    (first / "my_eval.json").unlink()
    prune_checkpoints(run, keep=1)  # fivefold's own files only: deleted
    assert list_checkpoints(run) == [second]


def word_tokenizer(folder: Path, ids: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(ids)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_export_and_generate_refuse_a_tokenizer_the_model_cannot_use(tmp_path, dataset, capsys):  # noqa: F811
    import tomllib

    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "1"}))
    vocab = tomllib.loads((run / "config.toml").read_text())["model"]["vocab_size"]
    big, other = word_tokenizer(tmp_path / "big", vocab + 10), word_tokenizer(tmp_path / "other", 50)
    capsys.readouterr()
    for argv in (["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf")],
                 ["generate", "--checkpoint", str(run), "--prompt", "w1", "--max-new-tokens", "1"]):
        refused(capsys, argv + ["--tokenizer", str(big)], "--tokenizer", f"{vocab + 10:,} token ids",
                f"vocab_size is {vocab:,}")
        refused(capsys, argv + ["--tokenizer", str(other)], "--tokenizer", "not the model's own tokenizer")
    assert not (tmp_path / "hf").exists()
    # the run's own tokenizer, named explicitly, is the model's own
    assert main(["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf"), "--tokenizer",
                 str(run / "tokenizer")]) == 0


def test_train_from_hf_refuses_model_settings_that_its_weights_fix(tmp_path, dataset, capsys):  # noqa: F811
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "1"}))
    hf = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--hf", str(hf)]) == 0
    capsys.readouterr()
    base = ["train", "--hf", str(hf), "--data", str(dataset), "--run-dir", str(tmp_path / "new"), "--max-steps", "1"]
    refused(capsys, base + ["--model.n_layers", "1"], "--model.n_layers = 1", "model.n_layers = 2", "drop it")
    refused(capsys, base + ["--model.max_seq_len", "16", "--train.seq_len", "32"], "--model.max_seq_len = 16")
    refused(capsys, base + ["--preset", "smollm-135m"], "--hf", "drop the preset")
    config = tmp_path / "mine.toml"
    config.write_text("[model]\nhidden = 32\n")
    refused(capsys, base + ["--config", str(config)], f"[model] hidden in {config}", "model.hidden")
    assert not (tmp_path / "new").exists()


def test_flags_that_would_be_ignored_are_refused(capsys, places):
    Path("hw.toml").write_text('base = "cpu"\n')
    refused(capsys, ["plan", "--model", "tiny", "--gpu", "h100", "--hardware", "hw.toml", "--global-batch", "1024",
                     "--seq-len", "128"], "--gpu 'h100'", "base = 'cpu'")
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--hardware", "hw.toml", "--global-batch", "1024",
                 "--seq-len", "128"]) == 0  # the same device: nothing dropped
    capsys.readouterr()
    refused(capsys, ["train", "--gpu", "h100", "--max-steps", "1"], "--gpu 'h100'", "--dry-run")
    word_tokenizer(Path("tok"), 50)
    refused(capsys, ["data", "prepare", "corpus.txt", "--out", "toks", "--tokenizer", "tok", "--vocab-size", "500"],
            "--vocab-size 500", "drop --vocab-size")
    assert not Path("toks").exists()


def test_a_list_field_with_spaces_is_not_read_as_one_number():
    from fivefold.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="separate the items with commas"):
        build_config(None, {"layout.stage_layers": "3 1"})
    assert build_config(None, {"layout.stage_layers": "[3, 1]"}).layout.stage_layers == [3, 1]


def test_resume_refuses_a_run_entry_of_the_wrong_kind(tmp_path, dataset):  # noqa: F811
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "1"}))
    (run / "metrics.jsonl").rename(run / "metrics.moved")
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(RunDirError, match="metrics.jsonl is a directory"):
        train(small_config(run, dataset, **{"train.max_steps": "2"}), resume=True)


def test_version_is_the_packages(capsys):
    import tomllib

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out.strip() == f"fivefold {project['version']}"


def test_dry_run_launch_line_is_the_command_given(tmp_path, dataset, capsys):  # noqa: F811
    run = tmp_path / "run"
    train(small_config(run, dataset, **{"train.max_steps": "1"}))
    capsys.readouterr()
    main(["train", "--resume", "--run-dir", str(run), "--max-steps", "3", "--dry-run"])
    out = capsys.readouterr().out
    launch = out.split("launch:")[1].strip().splitlines()[0]
    assert launch == f"fivefold train --max-steps 3 --run-dir {run} --resume --nproc 1", out


def test_an_ordinary_word_is_not_an_end_of_text_token(capsys, places):
    word_tokenizer(Path("tok"), 50)
    refused(capsys, ["data", "prepare", "corpus.txt", "--out", "toks", "--tokenizer", "tok", "--eos-token", "w3"],
            "--eos-token 'w3'", "ordinary word")
    assert not Path("toks").exists()


def test_cpu_dry_run_launches_the_processes_on_this_node(tmp_path, capsys):
    """On the CPU profile a device is a process of this machine: `--nproc 2` is launched as such, not as 2 nodes of
    one process each."""
    assert main(["train", "--dry-run", "--nproc", "2", "--layout.dp", "2", "--train.device", "cpu", "--run-dir",
                 str(tmp_path / "r")]) == 0
    launch = capsys.readouterr().out.split("launch:")[1].strip().splitlines()
    assert len(launch) == 1 and launch[0].endswith("--nproc 2") and "--nodes" not in launch[0]
