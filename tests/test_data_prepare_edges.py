"""`fivefold data prepare` at the edges of its input and of its process: text that is not Unicode, empty and null
documents, a corpus of whitespace, very long lines, and SIGTERM / SIGHUP during preparation (and before the first
step of `fivefold train`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.test_data import decode_documents

from fivefold.cli import main
from fivefold.data import TokenDataset, prepare_dataset
from fivefold.data import prepare as prepare_module
from fivefold.data.format import DataError

SMALL_VOCAB = 300


def no_training(*args, **kwargs):
    raise AssertionError("the tokenizer was trained: bad input must fail in the first pass")


def staging_dirs(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------------------------------------------
# text that no tokenizer takes


@pytest.mark.parametrize("given_tokenizer", [False, True])
def test_an_unpaired_surrogate_fails_in_the_first_pass_naming_file_line_and_field(tmp_path, capsys, monkeypatch,
                                                                                  given_tokenizer):
    (tmp_path / "ok.txt").write_text("an ordinary document with enough text in it\n" * 20)
    tokenizer = []
    if given_tokenizer:
        tokenizer = ["--tokenizer", str(prepare_dataset([tmp_path / "ok.txt"], tmp_path / "tk",
                                                        vocab_size=SMALL_VOCAB) / "tokenizer.json")]
    bad = tmp_path / "surr.jsonl"
    bad.write_text('{"text": "a doc"}\n\n{"body": "x", "text": "bad \\ud800 surrogate"}\n', encoding="utf-8")
    monkeypatch.setattr(prepare_module, "train_bpe_tokenizer", no_training)
    monkeypatch.setattr(prepare_module, "_tokenize_documents", no_training)
    args = ["data", "prepare", str(bad), "--out", str(tmp_path / "out"), *tokenizer]
    assert main(args + ([] if given_tokenizer else ["--vocab-size", str(SMALL_VOCAB)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"fivefold data: error: input {bad.resolve()}, line 3: field 'text' holds an unpaired "
                             "surrogate (\\ud800 at character 4)")
    assert not (tmp_path / "out").exists() and not staging_dirs(tmp_path)


def test_a_paired_surrogate_escape_is_ordinary_text(tmp_path):
    (tmp_path / "pair.jsonl").write_text('{"text": "emoji \\ud83d\\ude00 here"}\n' * 3)
    out = prepare_dataset([tmp_path / "pair.jsonl"], tmp_path / "out", vocab_size=SMALL_VOCAB, val_fraction=0)
    assert TokenDataset(out, "train").num_tokens > 3


# ---------------------------------------------------------------------------------------------------
# empty and null documents: counted and skipped, in every format


def test_empty_and_null_documents_are_counted_and_said(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    records = ["hello world"] * 5 + ["   "] * 2 + [""] * 4 + [None] * 3
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    pq.write_table(pa.table({"text": ["doc one is here"] * 6 + [None] * 2 + [""] * 1}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("")
    (tmp_path / "d.txt").write_text("a text file\n")
    assert main(["data", "prepare", str(tmp_path), "--out", str(tmp_path / "out"), "--vocab-size",
                 str(SMALL_VOCAB), "--val-fraction", "0"]) == 0
    captured = capsys.readouterr()
    # 7 + 6 + 1 documents; 4 + 1 + 1 empty (the empty .txt file is one), 3 + 2 null
    assert "read 4 file(s): 14 documents, " in captured.err
    assert "; skipped 6 empty and 5 null document(s)" in captured.err
    assert "documents skipped: 6 empty, 5 null" in captured.out
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["skipped_documents"] == {"empty": 6, "null": 5}
    assert index["splits"]["train"]["num_documents"] == 14


def test_the_skipped_count_is_said_under_quiet_too(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "one document"}\n{"text": null}\n{"text": ""}\n')
    assert main(["data", "prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"), "--vocab-size",
                 str(SMALL_VOCAB), "--val-fraction", "0", "--quiet"]) == 0
    assert "documents skipped: 1 empty, 1 null" in capsys.readouterr().out


def test_a_non_string_value_is_named_in_json_terms(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": [1, 2]}\n')
    assert main(["data", "prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert "line 2: field 'text' must be a string (or null), got a JSON array" in capsys.readouterr().err


@pytest.mark.parametrize("files", [{"ws.txt": "   \n\t\n  \n"}, {"ws.txt": " ", "e.txt": ""},
                                   {"ws.jsonl": '{"text": "  "}\n{"text": null}\n{"text": "\\n\\t"}\n'}])
def test_a_corpus_of_only_whitespace_is_refused_before_training(tmp_path, capsys, monkeypatch, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(prepare_module, "train_bpe_tokenizer", no_training)
    assert main(["data", "prepare", *(str(tmp_path / n) for n in files), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty corpus" in err[0] and "hold only whitespace" in err[0], err


def test_a_corpus_of_only_empty_documents_says_what_was_skipped(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    with pytest.raises(DataError, match=r"hold no text \(skipped 1 empty and 1 null document\(s\)\)"):
        prepare_dataset([tmp_path / "a.jsonl"], tmp_path / "out")


# ---------------------------------------------------------------------------------------------------
# very long lines: bounded pieces, and a warning


def test_long_lines_are_cut_into_bounded_pieces(tmp_path):
    words = " ".join(f"word{i % 97}" for i in range(3000))  # one line of ~20,000 characters
    text = "A first line.\n" + words + "\nshort\n" + "x" * 5000 + "\nthe end\n"
    pieces = prepare_module._text_pieces(text, 1000)
    assert "".join(pieces) == text
    assert all(1000 <= len(p) <= 2000 for p in pieces[:-1]) and len(pieces[-1]) <= 2000
    # the cuts inside the long line of words fall before a space: the pieces encode to the whole's tokens
    tokenizer = prepare_module.train_bpe_tokenizer(iter([words]), 512)
    word_pieces = prepare_module._text_pieces(words, 1000)
    assert len(word_pieces) > 10 and all(p.startswith(" ") for p in word_pieces[1:])
    whole = tokenizer.encode(words, add_special_tokens=False).ids
    assert [i for p in word_pieces for i in tokenizer.encode(p, add_special_tokens=False).ids] == whole


# the pre-tokenizers the cuts must not change: GPT-2's regex (what `train_bpe_tokenizer` uses) and Llama 3's, as
# their tokenizer.json files give them
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
# letters, digits, punctuation and every kind of whitespace: spaces, tabs, line breaks (\r\n, NEL, U+2028), Unicode
# spaces (no-break, em, ideographic) and \x1c, which Python counts as whitespace and the tokenizers as punctuation
ADVERSARIAL = "ab1.'_ \t\n\r\x0b\x0c\x85\xa0\u2003\u3000\u2028\x1c"


def pre_tokenizers_of_record():
    from tokenizers import Regex, pre_tokenizers

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    llama3 = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return {"gpt2": gpt2, "llama3": llama3}


PRE_TOKENIZERS = pre_tokenizers_of_record()


def pre_tokens(pre_tokenizer, text: str) -> list[str]:
    return [token for token, _ in pre_tokenizer.pre_tokenize_str(text)] if text else []


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(text=st.text(alphabet=ADVERSARIAL, max_size=60))
# the audit's: a line ending in spaces, blank lines, a line ending in a tab or a Unicode space, \r\n line ends
@example(text="end  \nNext line")
@example(text="end\n\nNext line")
@example(text="end\t\nNext line")
@example(text="end\u3000\nNext line")
@example(text="end\r\nNext line")
@example(text="end.\nNext line")
def test_every_cut_leaves_the_pre_tokens_of_the_whole(text):
    """The reference: the tokenizers' own pre-tokenization of the whole text. At every cut `_text_pieces` may make
    (a line or space cut, for pieces of any size), the two sides pre-tokenize to the whole's pre-tokens, under
    GPT-2's regex and Llama 3's: so the pieces encode to the whole's tokens whatever the merges."""
    cuts = {c for m in range(1, len(text) + 1) for c, how in prepare_module._cut_points(text, m) if how != "hard"}
    for name, pre_tokenizer in PRE_TOKENIZERS.items():
        whole = pre_tokens(pre_tokenizer, text)
        for c in sorted(cuts):
            assert pre_tokens(pre_tokenizer, text[:c]) + pre_tokens(pre_tokenizer, text[c:]) == whole, (name, c)


def test_lines_ending_in_whitespace_are_cut_exactly_and_token_for_token(monkeypatch, capsys):
    """A long document of lines ending in spaces, tabs, blank lines, \r\n and Unicode spaces, cut into pieces of
    about 200 characters: the pieces encode to the whole's tokens with a byte-level BPE tokenizer trained on it
    (every cut is a line or space cut), and no long-line warning is given (no line is long, no cut is hard)."""
    import random

    rng = random.Random(0)
    ends = ["  \n", "\t\n", "\n\n", "\r\n", " \r\n", "\u3000\n", "\xa0\n", "\n", ".\n", " \n\n\n"]
    words = ["alpha", "beta", "it's", "1234567", "x_y", "(z)", "don't", "\u00e9t\u00e9"]
    seps = [" ", "  ", "\t", "\u2003", " \t "]
    text = "".join(rng.choice(words) + "".join(rng.choice(seps) + rng.choice(words) for _ in range(rng.randint(0, 6)))
                   + rng.choice(ends) for _ in range(400))
    tokenizer = prepare_module.train_bpe_tokenizer(iter([text]), 400)
    pieces = prepare_module._text_pieces(text, 200)
    assert len(pieces) > 30 and "".join(pieces) == text
    assert all(how != "hard" for _, how in prepare_module._cut_points(text, 200))
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    assert [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False).ids] == whole
    for pre_tokenizer in PRE_TOKENIZERS.values():
        assert [t for p in pieces for t in pre_tokens(pre_tokenizer, p)] == pre_tokens(pre_tokenizer, text)
    assert prepare_module._long_line_warning(text, "input x", 200, True) is None


def test_hard_cuts_between_short_lines_are_warned_about_as_such():
    """Indented lines without a space inside: no line cut (each newline is followed by a tab) and no space cut (each
    tab follows a newline), so the pieces are cut every 100 characters where the tokens may differ. The warning says
    that, and does not call those 7-character lines long."""
    text = "".join(f"\tv{i % 10}=1\n" for i in range(300))
    cuts = list(prepare_module._cut_points(text, 100))
    assert cuts and all(how == "hard" for _, how in cuts)
    assert prepare_module._long_line_warning(text, "input x", 100, True) == (
        f"warning: input x: {len(cuts)} cut(s) of its text into pieces of 100 to 200 characters found no line break "
        "between two non-space characters and no space after one within 200 characters, so they fall where the "
        "tokens may differ from those of the whole text")


def test_the_cut_spaces_are_the_tokenizers_whitespace():
    """`CUT_SPACES` and the line breaks are exactly the characters that the tokenizers' regex counts as whitespace
    (found by pre-tokenizing "a" + c + c + "b": whitespace comes out as two tokens), among the characters that Python
    counts as whitespace (a sweep of every code point, 25 s, found none of the tokenizers' outside them)."""
    import re

    gpt2 = PRE_TOKENIZERS["gpt2"]
    python_spaces = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    theirs = {c for c in python_spaces if c == " " or len(pre_tokens(gpt2, f"a{c}{c}b")) == 4}
    cut = {c for c in python_spaces if re.fullmatch(f"[{prepare_module.CUT_SPACES}]", c)}
    assert cut == theirs - {"\r", "\n"}
    assert {"\x1c", "\x1d", "\x1e", "\x1f"} == set(python_spaces) - theirs


def test_a_long_line_is_warned_about_and_the_trainer_gets_bounded_pieces(tmp_path, monkeypatch, capsys):
    words = " ".join(f"word{i % 97}" for i in range(3000))
    (tmp_path / "big.txt").write_text("A first line.\n" + words + "\n" + "y" * 5000 + "\n")
    (tmp_path / "ok.txt").write_text("short lines\n" * 10)
    monkeypatch.setattr(prepare_module, "ENCODE_BATCH_CHARS", 1000)
    monkeypatch.setattr(prepare_module, "TRAIN_PIECE_CHARS", 500)
    seen: list[int] = []
    train = prepare_module.train_bpe_tokenizer

    def recording(documents, vocab_size):
        return train((seen.append(len(d)) or d for d in documents), vocab_size)

    monkeypatch.setattr(prepare_module, "train_bpe_tokenizer", recording)
    assert main(["data", "prepare", str(tmp_path), "--out", str(tmp_path / "out"), "--vocab-size",
                 str(SMALL_VOCAB), "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: input {(tmp_path / 'big.txt').resolve()}: 2 line(s) over 1,000 characters, the longest "
                   f"{len(words):,} (line 2): runs of over 2,000 characters without a space are cut every 1,000 "
                   "characters, and the tokens at those cuts may differ from those of the whole line"]
    assert seen and max(seen) <= 1000  # pieces of TRAIN_PIECE_CHARS to twice that
    assert TokenDataset(tmp_path / "out", "train").num_tokens > 0


# ---------------------------------------------------------------------------------------------------
# SIGTERM / SIGHUP


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_during_prepare_removes_the_staging_and_says_so(tmp_path, capsys, monkeypatch, signum):
    (tmp_path / "a.txt").write_text("some text to tokenize\n" * 50)
    tokenize = prepare_module._tokenize_documents

    def killed(*args, **kwargs):
        tokenize(*args, **kwargs)
        assert staging_dirs(tmp_path)  # shards are being written into it
        os.kill(os.getpid(), signum)
        time.sleep(30)  # the handler interrupts it
        raise AssertionError("the signal did not stop prepare")

    monkeypatch.setattr(prepare_module, "_tokenize_documents", killed)
    before = signal.getsignal(signum)
    rc = main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--vocab-size",
               str(SMALL_VOCAB)])
    name = signal.Signals(signum).name
    assert rc == 128 + signum
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"fivefold data: stopped by {name}; nothing was written to {tmp_path / 'out'}")
    assert not staging_dirs(tmp_path) and not (tmp_path / "out").exists()
    assert signal.getsignal(signum) == before  # restored


def signal_at_first_unlink(monkeypatch, signum: int) -> dict:
    """From `armed["on"]` being set: `signum` to this process at the first file removal (`os.unlink`, which
    `shutil.rmtree` calls per file), that file still removed after it; `armed["sent"]` counts the signals sent."""
    unlink, armed = os.unlink, {"on": False, "sent": 0}

    def signalling_unlink(*args, **kwargs):
        if armed["on"]:
            armed["on"] = False
            armed["sent"] += 1
            os.kill(os.getpid(), signum)  # handled (or noted) before the next line runs
        return unlink(*args, **kwargs)

    monkeypatch.setattr(os, "unlink", signalling_unlink)
    return armed


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)],
                         ids=["SIGTERM-SIGTERM", "SIGINT-SIGTERM"])
def test_a_second_signal_during_the_staging_removal_waits_for_it(tmp_path, capsys, monkeypatch, first, second):
    """The first signal stops the prepare while shards are written; the second comes while the staging directory
    is removed (at its first file). The removal runs to its end, no staging directory is left half removed, and
    the prepare stops by the second signal, in one line, its handlers restored."""
    (tmp_path / "a.txt").write_text("some text to tokenize\n" * 50)
    tokenize, armed = prepare_module._tokenize_documents, signal_at_first_unlink(monkeypatch, second)

    def killed(*args, **kwargs):
        tokenize(*args, **kwargs)
        (staging,) = staging_dirs(tmp_path)
        assert len(list(staging.iterdir())) >= 3  # the tokenizer and the shards: several files to remove
        armed["on"] = True
        os.kill(os.getpid(), first)
        time.sleep(30)  # the handler interrupts it
        raise AssertionError("the signal did not stop prepare")

    monkeypatch.setattr(prepare_module, "_tokenize_documents", killed)
    before = {s: signal.getsignal(s) for s in (first, second)}
    rc = main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--vocab-size",
               str(SMALL_VOCAB)])
    assert armed["sent"] == 1
    assert not staging_dirs(tmp_path) and not (tmp_path / "out").exists()
    assert rc == 128 + second
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"fivefold data: stopped by {signal.Signals(second).name}; nothing was written to " \
                      f"{tmp_path / 'out'}", err
    assert {s: signal.getsignal(s) for s in (first, second)} == before


def test_a_signal_while_overwrite_swaps_the_output_in_leaves_it_whole(tmp_path, capsys, monkeypatch):
    """--overwrite renames the previous output aside, the new one into place and removes the previous one; SIGTERM
    at the first file of that removal waits for it: the new output is in place and whole, nothing of the previous
    one or of the staging is left, and the line says the output was written."""
    (tmp_path / "a.txt").write_text("the first version of the text\n" * 50)
    out = tmp_path / "out"
    argv = ["data", "prepare", str(tmp_path / "a.txt"), "--out", str(out), "--vocab-size", str(SMALL_VOCAB),
            "--overwrite", "--quiet", "--val-fraction", "0"]
    assert main(argv) == 0
    (tmp_path / "a.txt").write_text("a second version of the text, longer than the first\n" * 80)
    rename, armed = os.rename, signal_at_first_unlink(monkeypatch, signal.SIGTERM)

    def arming_rename(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        if Path(dst) == out:  # the new output is in place: the previous one's removal comes next
            armed["on"] = True

    monkeypatch.setattr(os, "rename", arming_rename)
    rc = main(argv)
    assert armed["sent"] == 1 and rc == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"fivefold data: stopped by SIGTERM; {out} was written in full before it stopped")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]  # no staging, no previous output
    assert decode_documents(out, "train") == [(tmp_path / "a.txt").read_text()]


def test_stop_signal_handling_is_restored_after_prepare(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    before = signal.getsignal(signal.SIGTERM)
    prepare_dataset([tmp_path / "a.txt"], tmp_path / "out", vocab_size=SMALL_VOCAB)
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_of_a_prepare_process_exits_143_and_leaves_no_staging(tmp_path):
    script = (
        "import os, signal, sys\n"
        "from fivefold.data import prepare as p\n"
        "t = p._tokenize_documents\n"
        "def k(*a, **kw):\n"
        "    t(*a, **kw); os.kill(os.getpid(), signal.SIGTERM); import time; time.sleep(30)\n"
        "p._tokenize_documents = k\n"
        "from fivefold.cli import main\n"
        f"sys.exit(main(['data', 'prepare', {str(tmp_path / 'a.txt')!r}, '--out', {str(tmp_path / 'out')!r}, "
        f"'--vocab-size', '{SMALL_VOCAB}', '--quiet']))\n"
    )
    (tmp_path / "a.txt").write_text("some text to tokenize\n" * 50)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    assert done.returncode == 143, done.stderr
    assert done.stderr.strip() == f"fivefold data: stopped by SIGTERM; nothing was written to {tmp_path / 'out'}"
    assert not staging_dirs(tmp_path)


def test_staging_left_by_a_dead_prepare_on_this_host_is_removed(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = prepare_module._host_tag()
    stale = tmp_path / f".out.tmp-{host}-{dead.pid}-0123abcd"
    alive = tmp_path / f".out.tmp-{host}-{os.getppid()}-0123abcd"  # a process that lives: in use
    other_host = tmp_path / f".out.tmp-{host}x-{dead.pid}-0123abcd"
    old_form = tmp_path / f".out.tmp-{dead.pid}-0123abcd"
    other_output = tmp_path / f".other.tmp-{host}-{dead.pid}-0123abcd"
    for d in (stale, alive, other_host, old_form, other_output):
        d.mkdir()
        (d / "train_000000.bin").write_bytes(b"\0\0")
    prepare_dataset([tmp_path / "a.txt"], tmp_path / "out", vocab_size=SMALL_VOCAB)
    assert sorted(p.name for p in staging_dirs(tmp_path)) == sorted(
        p.name for p in (alive, other_host, old_form, other_output))


def test_sigterm_before_the_first_training_step_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("A line of text for a tiny model to read.\n" * 400)
    data = prepare_dataset([tmp_path / "a.txt"], tmp_path / "data", vocab_size=SMALL_VOCAB)
    from fivefold.train import loop

    def build_killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        raise AssertionError("SIGTERM did not stop the start of the run")

    monkeypatch.setattr(loop, "build_engine", build_killed)
    before = signal.getsignal(signal.SIGTERM)
    args = ["train", "--data", str(data), "--max-steps", "2", "--run-dir", str(tmp_path / "run"),
            "--model.n_layers", "1", "--model.hidden", "32", "--model.n_heads", "2", "--model.n_kv_heads", "1",
            "--model.ffn", "64", "--model.vocab_size", "320", "--train.seq_len", "16", "--train.global_batch_size",
            "2", "--train.warmup_steps", "1", "--train.dtype", "fp32", "--train.device", "cpu",
            "--train.threads", "1", "--log.progress", "none"]
    assert main(args) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("fivefold train: stopped by SIGTERM; before the first step, so nothing was trained and no "
                       "checkpoint written")
    assert signal.getsignal(signal.SIGTERM) == before
    monkeypatch.undo()
    assert main(args) == 0  # the run lock was released: the run directory is usable at once
