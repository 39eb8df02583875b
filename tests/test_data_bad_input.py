"""Bad data and checkpoint input refused up front, in one line naming the field or file (exit status 2, no traceback,
no run directory made): `data prepare --vocab-size` beyond what a tokenizer can be trained to, a damaged index.json
or tokenizer of a prepared directory (seen by `data info` and `train`), resuming on data of another tokenizer, and
resuming from a checkpoint whose listed files do not match its manifest (as `export` refuses them)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.data import prepare_dataset
from fivefold.data.tokenizer import MAX_TRAINED_VOCAB, check_vocab_size

CORPUS = Path(__file__).resolve().parents[1] / "src" / "fivefold" / "data" / "corpus"
MODEL = ["--model.n_layers", "1", "--model.hidden", "32", "--model.n_heads", "2", "--model.n_kv_heads", "1",
         "--model.ffn", "64", "--model.vocab_size", "512", "--train.seq_len", "16", "--train.global_batch_size", "2",
         "--train.warmup_steps", "0", "--train.eval_every", "0", "--train.eval_batches", "1",
         "--train.checkpoint_every", "2", "--train.threads", "1", "--log.progress", "none"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    text = gzip.open(next(CORPUS.glob("*.txt.gz")), "rt").read()[:16_000]
    (root / "plays.txt").write_text(text)
    return root / "plays.txt"


@pytest.fixture(scope="module")
def data(corpus) -> Path:
    """A prepared directory (a 300-id BPE trained on 16 KB)."""
    return prepare_dataset([corpus], corpus.parent / "good", vocab_size=300, val_fraction=0.1)


@pytest.fixture(scope="module")
def other_data(corpus) -> Path:
    """The same text prepared with another tokenizer (a 320-id BPE)."""
    return prepare_dataset([corpus], corpus.parent / "other", vocab_size=320, val_fraction=0.1)


@pytest.fixture(scope="module")
def run(data, tmp_path_factory) -> Path:
    """A run of 2 steps with its checkpoint at step 2."""
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", *MODEL, "--data", str(data), "--run-dir", str(run_dir), "--max-steps", "2"]) == 0
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    return run_dir


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def train_argv(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", *MODEL, "--data", str(data), "--run-dir", str(run_dir), "--max-steps", "2", *extra]


# ------------------------------------------------------------------------------------------------------------------
# data prepare --vocab-size


@pytest.mark.parametrize("vocab", ["2147483648", "99999999999", str(MAX_TRAINED_VOCAB + 1)])
def test_prepare_refuses_a_vocabulary_too_large_to_train(corpus, tmp_path, capsys, vocab):
    out = tmp_path / "out"
    assert main(["data", "prepare", "--quiet", str(corpus), "--vocab-size", vocab, "--out", str(out)]) == 2
    one_line_error(capsys, "--vocab-size", f"{int(vocab):,}", "too large", f"{MAX_TRAINED_VOCAB:,}")
    assert not out.exists()


def test_vocab_size_bounds_are_inclusive():
    check_vocab_size(257)
    check_vocab_size(MAX_TRAINED_VOCAB)


# ------------------------------------------------------------------------------------------------------------------
# a damaged index.json or tokenizer of a prepared directory

def _set(*keys):
    def change(index: dict, value) -> None:
        target = index
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return change


# (label, the change, the text the message must hold)
INDEX_DAMAGE = [
    ("dtype", lambda i: _set("dtype")(i, "float64"), "dtype = 'float64' is not one of uint16, uint32"),
    ("vocab_str", lambda i: _set("vocab_size")(i, "many"), "vocab_size = 'many'"),
    ("vocab_over_dtype", lambda i: _set("vocab_size")(i, 70_000), "vocab_size = 70000"),
    ("vocab_zero", lambda i: _set("vocab_size")(i, 0), "vocab_size = 0"),
    ("eos_big", lambda i: _set("eos_id")(i, 1_000_000), "eos_id = 1000000"),
    ("eos_float", lambda i: _set("eos_id")(i, 1.5), "eos_id = 1.5"),
    ("shard_escape", lambda i: _set("splits", "train", "shards", 0, "file")(i, "../../../etc/passwd"),
     "splits.train.shards[0].file '../../../etc/passwd'"),
    ("shard_absolute", lambda i: _set("splits", "val", "shards", 0, "file")(i, "/etc/passwd"),
     "splits.val.shards[0].file '/etc/passwd'"),
    ("shard_tokens", lambda i: _set("splits", "train", "shards", 0, "num_tokens")(i, "x"),
     "splits.train.shards[0].num_tokens = 'x'"),
    ("split_tokens", lambda i: _set("splits", "train", "num_tokens")(i, 7), "splits.train.num_tokens = 7"),
    ("no_val", lambda i: i["splits"].pop("val"), "splits.val = None"),
    ("tokenizer_escape", lambda i: _set("tokenizer", "file")(i, "../tokenizer.json"),
     "tokenizer.file '../tokenizer.json'"),
]


def damaged_copy(data: Path, tmp_path: Path, change=None) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    if change is not None:
        index = json.loads((copy / "index.json").read_text())
        change(index)
        (copy / "index.json").write_text(json.dumps(index))
    return copy


@pytest.mark.parametrize(("label", "change", "needle"), INDEX_DAMAGE, ids=[d[0] for d in INDEX_DAMAGE])
def test_damaged_index_is_refused_by_info_and_train(data, tmp_path, capsys, label, change, needle):
    copy = damaged_copy(data, tmp_path, change)
    assert main(["data", "info", str(copy)]) == 2
    one_line_error(capsys, "index.json", needle)
    run_dir = tmp_path / "run"
    assert main(train_argv(copy, run_dir)) == 2
    one_line_error(capsys, "index.json", needle)
    assert not run_dir.exists()


def test_missing_tokenizer_is_refused_before_the_run_dir_exists(data, tmp_path, capsys):
    copy = damaged_copy(data, tmp_path)
    (copy / "tokenizer.json").unlink()
    assert main(["data", "info", str(copy)]) == 2
    one_line_error(capsys, "no tokenizer file tokenizer.json")
    run_dir = tmp_path / "run"
    assert main(train_argv(copy, run_dir)) == 2
    one_line_error(capsys, "no tokenizer file tokenizer.json")
    assert not run_dir.exists()
    assert main(train_argv(damaged_copy(data, tmp_path / "again"), run_dir)) == 0  # the same run dir, unspoilt


def test_tokenizer_not_matching_its_recorded_sha256_is_refused(data, tmp_path, capsys):
    copy = damaged_copy(data, tmp_path)
    (copy / "tokenizer.json").write_text("garbage\n")
    run_dir = tmp_path / "run"
    assert main(train_argv(copy, run_dir)) == 2
    one_line_error(capsys, "tokenizer.json: sha256", "tokenizer.sha256")
    assert not run_dir.exists()


def test_unreadable_tokenizer_without_a_recorded_sha256_is_refused(data, tmp_path, capsys):
    copy = damaged_copy(data, tmp_path, lambda i: i["tokenizer"].pop("sha256"))
    (copy / "tokenizer.json").write_text('{"not": "a tokenizer"}\n')
    assert main(["data", "info", str(copy)]) == 2
    one_line_error(capsys, "tokenizer.json", "not a readable tokenizer.json")


def test_valid_data_still_opens(data, capsys):
    assert main(["data", "info", str(data), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size 300" in out and "sha256 verified" in out


# ------------------------------------------------------------------------------------------------------------------
# resume


def copy_run(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def fingerprint(data: Path) -> str:
    return json.loads((data / "index.json").read_text())["tokenizer"]["fingerprint"]


def test_resume_on_data_of_another_tokenizer_is_refused(run, data, other_data, tmp_path, capsys):
    copy = copy_run(run, tmp_path)
    before = sorted(p.name for p in copy.rglob("*"))
    assert main(["train", "--resume", "--run-dir", str(copy), "--data", str(other_data), "--max-steps", "3"]) == 2
    one_line_error(capsys, "--resume", "another tokenizer", str(copy / "tokenizer" / "tokenizer.json"),
                   fingerprint(other_data)[:12], fingerprint(data)[:12])
    assert sorted(p.name for p in copy.rglob("*")) == before  # nothing set aside, nothing written


def test_clean_resume_still_works(run, data, tmp_path, capsys):
    copy = copy_run(run, tmp_path)
    assert main(["train", "--resume", "--run-dir", str(copy), "--data", str(data), "--max-steps", "3"]) == 0
    assert (copy / "checkpoints" / "step_00000003" / "COMPLETE").is_file()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "flipped"])
@pytest.mark.parametrize("name", ["rank0.json", "index.json", "config.toml", "trainer_state.json",
                                  "rng-rank0.safetensors"])
def test_resume_refuses_a_checkpoint_file_at_odds_with_its_manifest(run, tmp_path, capsys, name, damage):
    copy = copy_run(run, tmp_path)
    checkpoint = copy / "checkpoints" / "step_00000002"
    damage(checkpoint / name)
    assert main(["train", "--resume", "--run-dir", str(copy), "--max-steps", "3"]) == 2
    one_line_error(capsys, "no usable checkpoint", f"{name} is corrupted")
    if name in ("rank0.json", "config.toml"):  # the files `export` checks: refused there too, naming the file
        assert main(["export", "--checkpoint", str(checkpoint), "--hf", str(tmp_path / "hf")]) == 2
        one_line_error(capsys, f"{name}")


def _garble(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)  # not UTF-8, not TOML


def _same_size_edit(path: Path) -> None:
    text = path.read_text()
    path.write_text(text.replace("n_layers = 1", "n_layers = 7"))  # still a valid config, of another model


@pytest.mark.parametrize("damage", [_truncate, _garble, _same_size_edit], ids=["truncated", "garbled", "edited"])
def test_export_and_generate_report_a_damaged_config_as_corrupted(run, tmp_path, capsys, damage):
    """A checkpoint's config.toml at odds with the manifest is reported as corrupted, naming it, before it is parsed
    (not as an invalid config or another model's shape)."""
    copy = copy_run(run, tmp_path)
    config = copy / "checkpoints" / "step_00000002" / "config.toml"
    damage(config)
    assert main(["export", "--checkpoint", str(copy), "--hf", str(tmp_path / "hf")]) == 2
    line = one_line_error(capsys, f"checkpoint file {config} is corrupted", "the manifest says")
    assert "not valid" not in line and "UTF-8" not in line
    assert not (tmp_path / "hf").exists()
    assert main(["generate", "--checkpoint", str(copy), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    one_line_error(capsys, f"checkpoint file {config} is corrupted")


def test_resume_reports_the_checkpoints_damaged_config_as_corrupted(run, tmp_path, capsys):
    """RUN_DIR/config.toml gone: the newest checkpoint's copy is read instead, checked against its manifest first."""
    copy = copy_run(run, tmp_path)
    (copy / "config.toml").unlink()
    config = copy / "checkpoints" / "step_00000002" / "config.toml"
    _truncate(config)
    assert main(["train", "--resume", "--run-dir", str(copy), "--max-steps", "3"]) == 2
    one_line_error(capsys, "--resume", f"checkpoint file {config} is corrupted")


def test_resume_without_the_runs_tokenizer_copy_is_refused(run, data, tmp_path, capsys):
    """Every run keeps its data's tokenizer in RUN_DIR/tokenizer/ before its first checkpoint: a run with
    checkpoints and no copy cannot be checked against the data it resumes on, and is refused before any model is
    built or file written."""
    copy = copy_run(run, tmp_path)
    shutil.rmtree(copy / "tokenizer")
    before = sorted(p.name for p in copy.rglob("*"))
    assert main(["train", "--resume", "--run-dir", str(copy), "--data", str(data), "--max-steps", "3"]) == 2
    one_line_error(capsys, "--resume", f"the run's tokenizer {copy / 'tokenizer' / 'tokenizer.json'} is missing",
                   "copy that data's tokenizer.json there")
    assert sorted(p.name for p in copy.rglob("*")) == before  # nothing written, the tokenizer not made up
    (copy / "tokenizer").mkdir()
    shutil.copyfile(data / "tokenizer.json", copy / "tokenizer" / "tokenizer.json")
    assert main(["train", "--resume", "--run-dir", str(copy), "--data", str(data), "--max-steps", "3"]) == 0


# ------------------------------------------------------------------------------------------------------------------
# export --tokenizer


@pytest.mark.parametrize(("name", "content", "said"), [
    ("junk.bin", bytes(range(256)), "not a readable tokenizer.json"),
    ("tokenizer.json", b"garbage{", "not a readable tokenizer.json"),
    ("other.json", b'{"not": "a tokenizer"}', "not a readable tokenizer.json"),
    ("mine.json", None, "is a tokenizer named 'mine.json'"),
])
def test_export_tokenizer_that_is_not_a_readable_tokenizer_is_named(run, data, tmp_path, capsys, name, content, said):
    """--tokenizer FILE is read before the weights: garbage is called not a readable tokenizer, naming the path (not
    "no tokenizer.json there"); a good tokenizer under another name is refused rather than its directory's
    tokenizer.json (if any) taken instead."""
    folder = tmp_path / "tok"
    folder.mkdir()
    given = folder / name
    given.write_bytes(content if content is not None else (data / "tokenizer.json").read_bytes())
    assert main(["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf"), "--tokenizer", str(given)]) == 2
    line = one_line_error(capsys, f"--tokenizer '{given}'", said)
    assert "no tokenizer.json there" not in line
    assert not (tmp_path / "hf").exists()
    assert main(["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf"), "--tokenizer",
                 str(tmp_path / "none.json")]) == 2
    one_line_error(capsys, f"--tokenizer '{tmp_path / 'none.json'}' does not exist")


def test_export_with_a_good_tokenizer_still_works(run, data, tmp_path, capsys):
    assert main(["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf"), "--tokenizer",
                 str(data / "tokenizer.json")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
