"""A value given as '' is refused naming the option (or argument), by every verb, before it runs: it would
otherwise read as "left out" (a default config, the built-in tokenizer) or as the current directory (export's
--hf, data prepare's INPUT), or fail inside with a traceback (generate --hf '')."""

from __future__ import annotations

from pathlib import Path

import pytest

from fivefold.cli import main

EMPTY: list[tuple[list[str], str]] = [
    (["generate", "--hf", ""], "--hf ''"),
    (["generate", "--checkpoint", ""], "--checkpoint ''"),
    (["generate", "--checkpoint", "run", "--tokenizer", " "], "--tokenizer ' '"),
    (["export", "--checkpoint", "", "--hf", "out"], "--checkpoint ''"),
    (["export", "--checkpoint", "run", "--hf", ""], "--hf ''"),
    (["export", "--checkpoint", "run", "--hf", "out", "--tokenizer", ""], "--tokenizer ''"),
    (["data", "prepare", "", "--out", "d"], "INPUT ''"),
    (["data", "prepare", "a.txt", "", "--out", "d"], "INPUT ''"),
    (["data", "prepare", "a.txt", "--out", "d", "--tokenizer", ""], "--tokenizer ''"),
    (["data", "prepare", "a.txt", "--out", "d", "--eos-token", ""], "--eos-token ''"),
    (["data", "info", ""], "DIR ''"),
    (["bench", "--model", "", "--steps", "1", "--warmup", "0", "--seq-len", "8"], "--model ''"),
    (["bench", "--config", "", "--steps", "1", "--warmup", "0", "--seq-len", "8"], "--config ''"),
    (["sweep", "", "--results", "r.db", "--dry-run"], "GRID ''"),
    (["report", "", "--out", "rep"], "RESULTS ''"),
    (["train", "--partition", "", "--dry-run"], "--partition ''"),
    (["train", "--time", "", "--dry-run"], "--time ''"),
]


@pytest.mark.parametrize(("argv", "said"), EMPTY, ids=[" ".join(a) for a, _ in EMPTY])
def test_an_empty_value_is_refused_naming_it(argv, said, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("some text to tokenize\n")
    (tmp_path / "run").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and f"{said} is empty" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_an_empty_default_stays_a_value(capsys):
    """Options whose default is '' take it when given: `plan --features ''` (no feature)."""
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--global-batch", "4096", "--seq-len", "128",
                 "--features", "", "--top", "1"]) == 0
