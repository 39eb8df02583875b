"""Data pipeline: prepare (txt / JSONL / Parquet), the shard format, TokenDataset, BatchSampler, val
batches, the built-in corpus and the `data` CLI verb."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from fivefold.cli import main
from fivefold.data import (
    BatchSampler,
    DataError,
    TokenDataset,
    builtin_documents,
    default_cache_dir,
    ensure_builtin_dataset,
    prepare_dataset,
    token_dtype,
    val_batches,
)
from fivefold.data import prepare as prepare_module
from fivefold.data.sampler import val_window_indices

SMALL_VOCAB = 300  # enough merges to exercise BPE, fast to train

DOCS = [
    "The quick brown fox jumps over the lazy dog.\nA second line, with punctuation!\n",
    "Ünïcödé text: naïve café, 東京, emoji 🦊 and tabs\tinside.\n",
    "Short one.",
    "Numbers 12345 and 3.14159 appear here.\n\nBlank line above.\n",
]


# ------------------------------------------------------------------------------------------------------
# helpers


def split_documents(tokens: np.ndarray, eos_id: int) -> list[list[int]]:
    """Token ids between end-of-text tokens (the stream must end with one)."""
    assert tokens[-1] == eos_id
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e].tolist() for s, e in zip(starts, ends, strict=True)]


def all_tokens(path: Path, split: str) -> np.ndarray:
    dataset = TokenDataset(path, split)
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in dataset.shards])


def decode_documents(path: Path, split: str) -> list[str]:
    dataset = TokenDataset(path, split)
    tokenizer = Tokenizer.from_file(str(dataset.tokenizer_path))
    return [
        tokenizer.decode(ids, skip_special_tokens=False)
        for ids in split_documents(all_tokens(path, split), dataset.eos_id)
    ]


def tree_digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def word_level_tokenizer(path: Path, n_words: int, eos: str = "</s>") -> Tokenizer:
    """A whitespace word-level tokenizer over w0..w{n-1}, with [UNK] = 0, `eos` = 1, [BOS] = n + 2."""
    bos_id = n_words + 2
    vocab = {"[UNK]": 0, eos: 1} | {f"w{i}": i + 2 for i in range(n_words)} | {"[BOS]": bos_id}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # like Llama 3's tokenizer, it adds a BOS token unless asked not to
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", bos_id)]
    )
    tokenizer.save(str(path))
    return tokenizer


def write_token_dir(path: Path, shards: list[np.ndarray], val: list[np.ndarray] | None = None) -> Path:
    """A prepared directory written by hand from the documented format (independent of prepare)."""
    path.mkdir(parents=True)
    splits = {}
    for split, arrays in (("train", shards), ("val", val or [])):
        entries = []
        for number, array in enumerate(arrays):
            name = f"{split}_{number:06d}.bin"
            data = np.asarray(array, dtype="<u2").tobytes()
            (path / name).write_bytes(data)
            entries.append(
                {"file": name, "num_tokens": len(array), "sha256": hashlib.sha256(data).hexdigest()}
            )
        splits[split] = {"num_tokens": sum(len(a) for a in arrays), "num_documents": 0, "shards": entries}
    index = {
        "format": "fivefold-tokens",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": 65536,
        "eos_id": 0,
        "eos_token": "<|endoftext|>",
        "tokenizer": {"file": "tokenizer.json"},
        "split": {"method": "none", "val_fraction": 0.0},
        "splits": splits,
        "sources": [],
    }
    (path / "index.json").write_text(json.dumps(index))
    return path


@pytest.fixture(scope="module")
def counting_dir(tmp_path_factory) -> Path:
    """Train tokens 0..N-1 in three shards of unequal size, so a window's first token is its position."""
    tokens = np.arange(1000)
    return write_token_dir(
        tmp_path_factory.mktemp("counting") / "d",
        [tokens[:400], tokens[400:750], tokens[750:]],
        val=[np.arange(5000, 5300)],
    )


def expected_window_starts(shard_sizes: list[int], seq_len: int) -> list[int]:
    """Closed form: windows every seq_len tokens, each needing seq_len + 1 tokens inside its shard."""
    starts, offset = [], 0
    for n in shard_sizes:
        starts += [offset + k * seq_len for k in range((n - 1) // seq_len)]
        offset += n
    return starts


# ------------------------------------------------------------------------------------------------------
# prepare: round trips


def test_prepare_txt_round_trip(tmp_path):
    source = tmp_path / "texts"
    (source / "sub").mkdir(parents=True)
    paths = [source / "a.txt", source / "b.txt", source / "sub" / "c.txt", source / "d.txt"]
    for path, text in zip(paths, DOCS, strict=True):
        path.write_text(text, encoding="utf-8")
    (source / "README.md").write_text("not an input")  # other extensions in a directory are skipped
    out = prepare_dataset([source], tmp_path / "out", vocab_size=SMALL_VOCAB, val_fraction=0.0)

    # files in sorted path order, each one document, each followed by EOS; byte-level BPE decodes exactly
    order = sorted(paths)
    assert decode_documents(out, "train") == [DOCS[paths.index(p)] for p in order]
    index = json.loads((out / "index.json").read_text())
    assert index["eos_token"] == "<|endoftext|>" and index["eos_id"] == 0
    assert index["dtype"] == "uint16" and index["vocab_size"] <= SMALL_VOCAB
    assert index["splits"]["train"]["num_documents"] == 4
    assert [s["path"] for s in index["sources"]] == [str(p.resolve()) for p in order]
    assert [s["size"] for s in index["sources"]] == [p.stat().st_size for p in order]
    assert (out / "tokenizer.json").is_file()
    for shard in index["splits"]["train"]["shards"]:
        assert hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]


def test_prepare_jsonl_round_trip_and_shards(tmp_path):
    records = [{"id": i, "body": f"Record {i}: " + DOCS[i % len(DOCS)]} for i in range(12)]
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(r) for r in records]
    lines.insert(5, "   ")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = prepare_dataset(
        [path], tmp_path / "out", vocab_size=SMALL_VOCAB, field="body", val_fraction=0.0, shard_tokens=50
    )

    assert decode_documents(out, "train") == [r["body"] for r in records]
    index = json.loads((out / "index.json").read_text())
    shards = index["splits"]["train"]["shards"]
    assert (
        len(shards) > 1
        and all(s["num_tokens"] == 50 for s in shards[:-1])
        and 0 < shards[-1]["num_tokens"] <= 50
    )
    assert [s["file"] for s in shards] == [f"train_{i:06d}.bin" for i in range(len(shards))]
    assert index["sources"][0]["field"] == "body"


def test_prepare_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"Row {i}. " + DOCS[i % len(DOCS)] for i in range(9)]
    table = pa.table({"content": texts + [None], "n": list(range(10))})
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=4)
    out = prepare_dataset(
        [tmp_path / "data.parquet"],
        tmp_path / "out",
        vocab_size=SMALL_VOCAB,
        field="content",
        val_fraction=0.0,
    )
    assert decode_documents(out, "train") == texts  # the null row is no document


def test_given_tokenizer_is_used_as_is(tmp_path):
    tokenizer_path = tmp_path / "my-tokenizer.json"
    tokenizer = word_level_tokenizer(tokenizer_path, 50, eos="</s>")
    texts = ["w1 w2 w3", "w49 w0 unknown w7"]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    out = prepare_dataset(
        [tmp_path / "0.txt", tmp_path / "1.txt"], tmp_path / "out", tokenizer=tokenizer_path, val_fraction=0.0
    )

    assert (out / "tokenizer.json").read_bytes() == tokenizer_path.read_bytes()
    assert tokenizer.encode(texts[0]).ids == [52, 3, 4, 5]  # by default this tokenizer adds [BOS] = 52
    # "wK" is id K + 2, unknown words are 0, each document ends with </s> = 1, and no [BOS] is added
    assert all_tokens(out, "train").tolist() == [3, 4, 5, 1, 51, 2, 0, 9, 1]
    index = json.loads((out / "index.json").read_text())
    assert (index["eos_token"], index["eos_id"], index["vocab_size"]) == ("</s>", 1, 53)


def test_token_dtype_choice(tmp_path):
    assert token_dtype(2048) == np.dtype("<u2")
    assert token_dtype(65536) == np.dtype("<u2")  # ids 0..65535 fit
    assert token_dtype(65537) == np.dtype("<u4")
    tokenizer_path = tmp_path / "big.json"
    word_level_tokenizer(tokenizer_path, 70_000)
    (tmp_path / "a.txt").write_text("w5 w65534 w69999 w65533")
    out = prepare_dataset([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tokenizer_path, val_fraction=0.0)
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_003
    assert all_tokens(out, "train").tolist() == [7, 65536, 70001, 65535, 1]
    assert (out / "train_000000.bin").stat().st_size == 5 * 4


def test_prepare_is_deterministic(tmp_path):
    for i, text in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(text)
    inputs = [tmp_path / f"{i}.txt" for i in range(len(DOCS))]
    first = prepare_dataset(inputs, tmp_path / "one", vocab_size=SMALL_VOCAB, val_fraction=0.25)
    second = prepare_dataset(inputs, tmp_path / "two", vocab_size=SMALL_VOCAB, val_fraction=0.25)
    one, two = tree_digest(first), tree_digest(second)
    one.pop("index.json"), two.pop("index.json")  # holds the creation time
    assert one == two


def test_large_documents_are_encoded_in_pieces_exactly(tmp_path):
    text = builtin_documents()[0][:60_000]
    tokenizer = prepare_module.train_bpe_tokenizer(iter([text]), 512)
    pieces = prepare_module._text_pieces(text, 1000)
    assert len(pieces) > 30 and "".join(pieces) == text
    assert all(len(p) >= 1000 and p.endswith("\n") for p in pieces[:-1])
    assert all(not p[0].isspace() for p in pieces[1:])
    assert prepare_module._text_pieces("short", 1000) == ["short"]
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    assert [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False).ids] == whole
    (tmp_path / "big.txt").write_text(text)
    monkey_chars = prepare_module.ENCODE_BATCH_CHARS
    try:
        prepare_module.ENCODE_BATCH_CHARS = 1000
        out = prepare_dataset(
            [tmp_path / "big.txt"], tmp_path / "out", tokenizer=None, vocab_size=512, val_fraction=0.0
        )
    finally:
        prepare_module.ENCODE_BATCH_CHARS = monkey_chars
    assert decode_documents(out, "train") == [text]


# ------------------------------------------------------------------------------------------------------
# validation split


def test_tail_split_holds_out_the_end_of_the_text(tmp_path):
    lines = [f"Line number {i} of the story." for i in range(200)]
    docs = ["\n".join(lines[:80]) + "\n", "\n".join(lines[80:]) + "\n"]
    for i, text in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(text)
    out = prepare_dataset(
        [tmp_path / "0.txt", tmp_path / "1.txt"], tmp_path / "out", vocab_size=SMALL_VOCAB, val_fraction=0.1
    )
    index = json.loads((out / "index.json").read_text())
    assert index["split"]["method"] == "tail"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    train = tokenizer.decode(all_tokens(out, "train").tolist(), skip_special_tokens=False)
    val = tokenizer.decode(all_tokens(out, "val").tolist(), skip_special_tokens=False)
    eos = "<|endoftext|>"
    # train then val is the whole corpus; val is its last ~10 % of characters, cut at a line start
    assert train + val == docs[0] + eos + docs[1] + eos
    assert val.startswith("Line number ") and val.endswith(eos)
    total = len(docs[0]) + len(docs[1])
    assert 0.1 * total <= len(val) - len(eos) < 0.1 * total + len(lines[-1]) + 2


def test_document_split_is_disjoint_and_deterministic(tmp_path):
    records = [{"text": f"Document {i} says {'hello ' * (i % 7 + 1)}"} for i in range(400)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    out = prepare_dataset([path], tmp_path / "out", vocab_size=SMALL_VOCAB, val_fraction=0.1)
    index = json.loads((out / "index.json").read_text())
    assert index["split"]["method"] == "documents"
    train, val = decode_documents(out, "train"), decode_documents(out, "val")
    assert len(val) == 40 and len(train) == 360
    assert set(train).isdisjoint(val) and set(train) | set(val) == {r["text"] for r in records}
    assert [d for d in (r["text"] for r in records) if d in set(train)] == train  # corpus order kept
    again = prepare_dataset([path], tmp_path / "again", vocab_size=SMALL_VOCAB, val_fraction=0.1)
    assert decode_documents(again, "val") == val


# ------------------------------------------------------------------------------------------------------
# errors


def bad_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    return path


@pytest.mark.parametrize(
    "files, given, kwargs, pattern",
    [
        ({}, "missing.txt", {}, r"missing\.txt: no such file"),
        (
            {"empty-dir/notes.md": "x"},
            "empty-dir",
            {},
            r"empty-dir: no input files found \(looked for \.txt, \.jsonl, \.parquet\)",
        ),
        ({"table.csv": "a,b"}, "table.csv", {}, r"table\.csv: unknown extension '\.csv'; valid"),
        (
            {"bad.jsonl": '{"text": "fine"}\n{"body": "no text field"}\n'},
            "bad.jsonl",
            {},
            r"bad\.jsonl, line 2: no field 'text' \(fields on this line: 'body'",
        ),
        ({"j.jsonl": '{"text": "a"}\n\n{"text": "b",}\n'}, "j.jsonl", {}, r"j\.jsonl, line 3: invalid JSON"),
        ({"n.jsonl": '{"text": 5}\n'}, "n.jsonl", {}, r"n\.jsonl, line 1: field 'text' must be a string"),
        ({"e.txt": "", "f.txt": ""}, ".", {}, r"empty corpus: the 2 input file\(s\) hold no text"),
        ({"l.txt": b"caf\xe9"}, "l.txt", {}, r"l\.txt: not UTF-8"),
        ({"ok.txt": "hello"}, "ok.txt", {"vocab_size": 100}, r"--vocab-size 100 is too small"),
        ({"ok.txt": "hello"}, "ok.txt", {"val_fraction": 0.9}, r"--val-fraction 0\.9"),
        ({"ok.txt": "hello"}, "ok.txt", {"field": ""}, r"--field: must name"),
    ],
)
def test_bad_input_errors(tmp_path, files, given, kwargs, pattern):
    source = tmp_path / "in"
    source.mkdir()
    for name, content in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (source / name).write_bytes(content)
        else:
            (source / name).write_text(content)
    with pytest.raises(DataError, match=pattern):
        prepare_dataset([source / given], tmp_path / "out", **{"vocab_size": SMALL_VOCAB} | kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output, no staging left behind


def test_unreadable_input_file(tmp_path, monkeypatch):
    (tmp_path / "secret.txt").write_text("x")
    monkeypatch.setattr(prepare_module.os, "access", lambda path, mode: False)  # tests run as root
    with pytest.raises(DataError, match=r"secret\.txt: not readable"):
        prepare_dataset([tmp_path / "secret.txt"], tmp_path / "out")


def test_parquet_without_the_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["a", "b"], "id": [1, 2]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: no column 'text' \(columns: 'body', 'id'"):
        prepare_dataset([tmp_path / "p.parquet"], tmp_path / "out")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "q.parquet")
    with pytest.raises(DataError, match=r"q\.parquet: column 'text' must hold strings"):
        prepare_dataset([tmp_path / "q.parquet"], tmp_path / "out")


def test_tokenizer_file_errors(tmp_path):
    (tmp_path / "a.txt").write_text("w1 w2")
    with pytest.raises(DataError, match=r"tokenizer .*nope\.json: no such file"):
        prepare_dataset([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "nope.json")
    (tmp_path / "garbage.json").write_text("{not a tokenizer")
    with pytest.raises(DataError, match=r"garbage\.json: not a readable tokenizer\.json"):
        prepare_dataset([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "garbage.json")
    word_level_tokenizer(tmp_path / "odd.json", 5, eos="[END]")
    with pytest.raises(DataError, match=r"odd\.json: has none of the end-of-text tokens .*--eos-token"):
        prepare_dataset([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "odd.json")
    out = prepare_dataset(
        [tmp_path / "a.txt"],
        tmp_path / "out",
        tokenizer=tmp_path / "odd.json",
        eos_token="[END]",
        val_fraction=0,
    )
    assert all_tokens(out, "train").tolist() == [3, 4, 1]


def test_failed_prepare_leaves_existing_output_untouched(tmp_path, monkeypatch):
    (tmp_path / "good.txt").write_text(DOCS[0])
    out = prepare_dataset([tmp_path / "good.txt"], tmp_path / "out", vocab_size=SMALL_VOCAB)
    before = tree_digest(out)

    with pytest.raises(DataError, match="directory is not empty; pass --overwrite"):
        prepare_dataset([tmp_path / "good.txt"], out, vocab_size=SMALL_VOCAB)
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2"):
        prepare_dataset([bad_jsonl(tmp_path)], out, vocab_size=SMALL_VOCAB, overwrite=True)

    def fail_midway(self, ids):
        raise OSError("disk full")

    monkeypatch.setattr(prepare_module.ShardWriter, "write", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        prepare_dataset([tmp_path / "good.txt"], out, vocab_size=SMALL_VOCAB, overwrite=True)
    monkeypatch.undo()
    assert tree_digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.txt", "out"]  # no staging dirs

    (tmp_path / "other.txt").write_text(DOCS[1])
    prepare_dataset([tmp_path / "other.txt"], out, vocab_size=SMALL_VOCAB, val_fraction=0.0, overwrite=True)
    assert decode_documents(out, "train") == [DOCS[1]]


def test_overwrite_of_a_foreign_index_says_so_in_words(tmp_path):
    """A directory whose only file is an index.json that prepare did not write: refused, in a sentence that reads."""
    (tmp_path / "a.txt").write_text(DOCS[0])
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "index.json").write_text("my own notes")
    with pytest.raises(DataError, match=r"mine: its index\.json is not one that `fivefold data prepare` wrote, so it "
                                        r"is no prepared token directory; refusing to delete it"):
        prepare_dataset([tmp_path / "a.txt"], foreign, vocab_size=SMALL_VOCAB, overwrite=True)
    assert (foreign / "index.json").read_text() == "my own notes"


def test_overwrite_never_deletes_foreign_files(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(
        DataError, match=r"holds 'thesis\.tex', which is not part of a prepared token directory"
    ):
        prepare_dataset([tmp_path / "a.txt"], foreign, vocab_size=SMALL_VOCAB, overwrite=True)
    assert (foreign / "thesis.tex").read_text() == "precious"
    out = prepare_dataset([tmp_path / "a.txt"], tmp_path / "out", vocab_size=SMALL_VOCAB)
    (out / "notes.txt").write_text("added by hand")
    with pytest.raises(DataError, match=r"holds 'notes\.txt'"):
        prepare_dataset([tmp_path / "a.txt"], out, vocab_size=SMALL_VOCAB, overwrite=True)
    assert (out / "notes.txt").exists()


# ------------------------------------------------------------------------------------------------------
# TokenDataset


def test_token_dataset_windows_follow_the_closed_form(counting_dir):
    dataset = TokenDataset(counting_dir)
    assert (dataset.num_tokens, dataset.vocab_size, dataset.eos_id) == (1000, 65536, 0)
    for seq_len in (1, 7, 16, 100, 349):
        starts = expected_window_starts([400, 350, 250], seq_len)
        assert dataset.num_windows(seq_len) == len(starts)
        got = [dataset.window(i, seq_len) for i in range(len(starts))]
        assert [int(w[0]) for w in got] == starts
        assert all(np.array_equal(w, np.arange(w[0], w[0] + seq_len + 1)) for w in got)
    with pytest.raises(IndexError):
        dataset.window(dataset.num_windows(16), 16)
    dataset.check_model_vocab(65536)
    with pytest.raises(DataError, match=r"model.vocab_size 2048 is smaller .* set model.vocab_size >= 65536"):
        dataset.check_model_vocab(2048)


def test_truncated_or_missing_shard_is_detected(tmp_path):
    path = write_token_dir(tmp_path / "d", [np.arange(100), np.arange(50)])
    shard = path / "train_000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"train_000001\.bin: 98 bytes, but index\.json lists 50 tokens"):
        TokenDataset(path)
    shard.unlink()
    with pytest.raises(DataError, match=r"train_000001\.bin: missing shard"):
        TokenDataset(path)
    first = path / "train_000000.bin"
    data = bytearray(first.read_bytes())
    data[10] ^= 1
    first.write_bytes(bytes(data))
    shard.write_bytes(np.arange(50, dtype="<u2").tobytes())
    dataset = TokenDataset(path)  # sizes match, so opening works; the checksum does not
    with pytest.raises(DataError, match=r"train_000000\.bin: sha256 differs"):
        dataset.verify()
    with pytest.raises(DataError, match=r"the val split holds no tokens"):
        TokenDataset(path, "val")
    with pytest.raises(DataError, match=r"no index\.json"):
        TokenDataset(tmp_path)


# ------------------------------------------------------------------------------------------------------
# BatchSampler


def window_starts(inputs: torch.Tensor) -> list[int]:
    return inputs[:, 0].tolist()


def test_batches_are_shifted_windows_and_deterministic(counting_dir):
    dataset = TokenDataset(counting_dir)
    sampler = BatchSampler(dataset, seq_len=16, global_batch_size=8, seed=3)
    inputs, targets = sampler.global_batch(0)
    assert inputs.dtype == torch.int64 and inputs.shape == targets.shape == (8, 16)
    assert torch.equal(targets, inputs + 1)  # tokens count up, so the next token is +1
    assert set(window_starts(inputs)) <= set(expected_window_starts([400, 350, 250], 16))
    again = BatchSampler(dataset, seq_len=16, global_batch_size=8, seed=3)
    assert all(torch.equal(sampler.global_batch(s)[0], again.global_batch(s)[0]) for s in range(5))
    other = BatchSampler(dataset, seq_len=16, global_batch_size=8, seed=4)
    assert not torch.equal(other.global_batch(0)[0], inputs)


@pytest.mark.parametrize("batch_size", [8, 6, 61])
def test_every_window_once_per_epoch(counting_dir, batch_size):
    dataset = TokenDataset(counting_dir)
    starts = expected_window_starts([400, 350, 250], 16)
    sampler = BatchSampler(dataset, seq_len=16, global_batch_size=batch_size, seed=0)
    n = len(starts)
    steps = -(-3 * n // batch_size)
    seen = [s for step in range(steps) for s in window_starts(sampler.global_batch(step)[0])]
    epochs = [seen[e * n : (e + 1) * n] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == starts  # no repeats, nothing left out
    assert epochs[0] != epochs[1]  # a new order each epoch


def test_dp_ranks_split_the_same_global_batch(counting_dir):
    dataset = TokenDataset(counting_dir)
    reference = BatchSampler(dataset, seq_len=8, global_batch_size=8, seed=11)
    for dp in (1, 2, 4):
        sampler = BatchSampler(dataset, seq_len=8, global_batch_size=8, seed=11)
        for step in (0, 1, 7, 40):
            parts = [sampler.rank_batch(step, rank, dp) for rank in range(dp)]
            inputs = torch.cat([p[0] for p in parts])
            targets = torch.cat([p[1] for p in parts])
            global_inputs, global_targets = reference.global_batch(step)
            assert torch.equal(inputs, global_inputs) and torch.equal(targets, global_targets)
            assert len({s for p in parts for s in window_starts(p[0])}) == 8  # ranks read disjoint rows
    with pytest.raises(DataError, match="not divisible by dp_size 3"):
        reference.rank_batch(0, 0, 3)


def test_resumed_sampler_reads_what_it_would_have(counting_dir):
    dataset = TokenDataset(counting_dir)
    running = BatchSampler(dataset, seq_len=16, global_batch_size=6, seed=5)
    history = [running.global_batch(step)[0] for step in range(30)]
    for k in (0, 9, 10, 29):
        resumed = BatchSampler(dataset, seq_len=16, global_batch_size=6, seed=5)
        assert torch.equal(resumed.rank_batch(k, 1, 2)[0], history[k][3:])
        assert torch.equal(resumed.global_batch(k)[0], history[k])


def test_too_short_dataset_error(counting_dir):
    with pytest.raises(
        DataError, match=r"1,000 tokens \(longest shard 400\) hold no window of seq_len 400 .*seq_len <= 399"
    ):
        BatchSampler(TokenDataset(counting_dir), seq_len=400, global_batch_size=2, seed=0)


def test_val_batches_are_fixed_and_from_the_val_split(counting_dir):
    val = TokenDataset(counting_dir, "val")
    first = list(val_batches(val, seq_len=10, batch_size=4, n_batches=3))
    second = list(val_batches(val, seq_len=10, batch_size=4, n_batches=3))
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
    starts = [s for inputs, _ in first for s in window_starts(inputs)]
    assert len(set(starts)) == 12 and all(5000 <= s < 5300 for s in starts)
    halves = [list(val_batches(val, 10, 4, 3, dp_rank=r, dp_size=2)) for r in range(2)]
    for batch in range(3):
        assert torch.equal(torch.cat([halves[0][batch][0], halves[1][batch][0]]), first[batch][0])
    assert val_window_indices(5, 2, 4).tolist() == [0, 1, 2, 3, 4, 0, 1, 2]  # wraps when the split is small


# ------------------------------------------------------------------------------------------------------
# built-in corpus and CLI


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    path = ensure_builtin_dataset(cache)
    assert path == cache / "shakespeare-v1-bpe2048"
    return path


def test_builtin_dataset_prepared_and_loadable(builtin_dir, tmp_path):
    plays = builtin_documents()
    assert len(plays) == 10 and plays[0].startswith("Hamlet\n") and plays[-1].startswith("The Tempest\n")
    assert not any(mark in "".join(plays) for mark in ("**", "_", "\\["))
    path = builtin_dir
    train, val = TokenDataset(path, "train"), TokenDataset(path, "val")
    assert train.vocab_size == 2048 and train.eos_id == 0
    assert 0.03 < val.num_tokens / (train.num_tokens + val.num_tokens) < 0.07
    tokenizer = Tokenizer.from_file(str(train.tokenizer_path))
    text = tokenizer.decode(
        all_tokens(path, "train").tolist() + all_tokens(path, "val").tolist(), skip_special_tokens=False
    )
    assert text == "".join(play + "<|endoftext|>" for play in plays)
    sampler = BatchSampler(train, seq_len=128, global_batch_size=4, seed=0)
    assert sampler.global_batch(0)[0].max() < 2048

    stamp = (path / "index.json").stat().st_mtime_ns
    assert ensure_builtin_dataset(path.parent) == path and (path / "index.json").stat().st_mtime_ns == stamp

    damaged = shutil.copytree(path, tmp_path / path.name)
    shard = damaged / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    assert ensure_builtin_dataset(tmp_path) == damaged  # prepared again
    TokenDataset(damaged).verify()
    assert tree_digest(damaged).keys() == tree_digest(path).keys()


def test_builtin_dataset_published_by_another_process(builtin_dir, tmp_path, monkeypatch):
    # publish refuses to replace an output that appeared meanwhile, and leaves that output alone
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "index.json").write_text("{}")
    theirs = shutil.copytree(builtin_dir, tmp_path / "theirs")
    with pytest.raises(prepare_module.OutputExistsError, match="appeared while preparing"):
        prepare_module.publish(staging, theirs, overwrite=False)
    assert tree_digest(theirs) == tree_digest(builtin_dir)

    # ensure_builtin_dataset then returns the directory the other process published
    def other_process_wins(stream, sources, num_files, out, **kwargs):
        shutil.copytree(builtin_dir, out)
        raise prepare_module.OutputExistsError(f"--out {out}: appeared while preparing")

    monkeypatch.setattr("fivefold.data.builtin.prepare_documents", other_process_wins)
    assert ensure_builtin_dataset(tmp_path / "cache") == tmp_path / "cache" / builtin_dir.name

    def other_process_published_garbage(stream, sources, num_files, out, **kwargs):
        out.mkdir(parents=True)
        raise prepare_module.OutputExistsError(f"--out {out}: appeared while preparing")

    monkeypatch.setattr("fivefold.data.builtin.prepare_documents", other_process_published_garbage)
    with pytest.raises(prepare_module.OutputExistsError):
        ensure_builtin_dataset(tmp_path / "other-cache")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FIVEFOLD_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "fivefold"


def test_cli_prepare_and_info(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(DOCS[0])
    out = tmp_path / "out"
    args = [
        "data",
        "prepare",
        str(tmp_path / "a.txt"),
        "--out",
        str(out),
        "--vocab-size",
        "300",
        "--val-fraction",
        "0",
    ]
    assert main(args) == 0
    assert decode_documents(out, "train") == [DOCS[0]]
    captured = capsys.readouterr()
    assert "train" in captured.out and "tokenized 1 file(s)" in captured.err  # summary and progress
    assert main(args) == 2
    assert "directory is not empty; pass --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--quiet"]) == 0
    assert main(["data", "info", str(out), "--verify"]) == 0
    assert "sha256 verified" in capsys.readouterr().out
    assert main(["data", "prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x")]) == 2
    assert "nope.txt: no such file" in capsys.readouterr().err


def _prepare_builtin_in_process(cache: str) -> str:
    path = ensure_builtin_dataset(Path(cache))
    TokenDataset(path).verify()
    return str(path)


@pytest.mark.slow
def test_builtin_dataset_prepared_by_several_processes_at_once(tmp_path):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(3) as pool:
        paths = pool.map(_prepare_builtin_in_process, [str(tmp_path)] * 3)
    assert len(set(paths)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shakespeare-v1-bpe2048"]  # no staging left
    TokenDataset(paths[0], "val").verify()


def test_tokenizer_from_a_hf_model_directory_and_its_fingerprint(tmp_path):
    from fivefold.data.format import tokenizer_fingerprint

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    word_level_tokenizer(model_dir / "tokenizer.json", 50, eos="w7")  # eos named by the model's config only
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w7"}))
    (tmp_path / "0.txt").write_text("w1 w2 w3")
    out = prepare_dataset([tmp_path / "0.txt"], tmp_path / "out", tokenizer=model_dir, val_fraction=0.0)
    index = json.loads((out / "index.json").read_text())
    assert (index["eos_token"], index["eos_id"]) == ("w7", 9)
    # the canonical content: the same tokenizer written with other formatting has the same fingerprint
    canonical = hashlib.sha256(json.dumps(json.loads((model_dir / "tokenizer.json").read_text()), sort_keys=True,
                                          separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
    assert index["tokenizer"]["fingerprint"] == canonical == TokenDataset(out, "train").tokenizer_fingerprint
    (tmp_path / "pretty.json").write_text(json.dumps(json.loads((model_dir / "tokenizer.json").read_text()),
                                                     indent=4))
    assert tokenizer_fingerprint(tmp_path / "pretty.json") == canonical
    # an index written before fingerprints were recorded still loads; the fingerprint comes from its tokenizer.json
    del index["tokenizer"]["fingerprint"]
    (out / "index.json").write_text(json.dumps(index))
    assert TokenDataset(out, "train").tokenizer_fingerprint == canonical
    # a directory without a tokenizer.json is named
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a directory without tokenizer.json"):
        prepare_dataset([tmp_path / "0.txt"], tmp_path / "out2", tokenizer=tmp_path / "empty")


# ------------------------------------------------------------------------------------------------------
# document lengths in the index


def lengths_between_eos(tokens: np.ndarray, eos_id: int) -> list[int]:
    """Each document's length counted from the token stream alone: up to and including each EOS, and the tokens
    after the last EOS as one more document."""
    lengths, run = [], 0
    for token in tokens.tolist():
        run += 1
        if token == eos_id:
            lengths.append(run)
            run = 0
    return lengths + ([run] if run else [])


def power_of_two_histogram(lengths: list[int]) -> list[dict]:
    """The documented histogram, built by a plain loop: bin [2^k, 2^(k+1)) with its count and sums of L, L^2, L^3."""
    bins: dict[int, list[int]] = {}
    for n in lengths:
        start = 1
        while start * 2 <= n:
            start *= 2
        acc = bins.setdefault(start, [0, 0, 0, 0])
        for i in range(4):
            acc[i] += n ** i
    return [{"from": s, "to": 2 * s - 1, "documents": a[0], "tokens": a[1], "tokens_squared": a[2],
             "tokens_cubed": a[3]} for s, a in sorted(bins.items())]


def check_documents_entry(path: Path, split: str, expected_lengths: list[int]) -> None:
    entry = json.loads((path / "index.json").read_text())["splits"][split]["documents"]
    assert entry["boundary"] == "eos_id"
    assert entry["count"] == len(expected_lengths) and entry["tokens"] == sum(expected_lengths)
    assert entry["longest"] == max(expected_lengths)
    assert entry["mean"] == pytest.approx(sum(expected_lengths) / len(expected_lengths), abs=1e-3)
    assert entry["histogram"] == power_of_two_histogram(expected_lengths)


def test_index_records_the_documents_lengths(tmp_path):
    # documents of very different lengths, some crossing the 40-token shards
    records = [{"text": " ".join(f"w{i % 7}" for i in range(n))} for n in (1, 3, 9, 40, 2, 150, 17, 64, 5, 300)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer_file = tmp_path / "tok.json"
    word_level_tokenizer(tokenizer_file, 7)
    out = prepare_dataset([path], tmp_path / "out", tokenizer=tokenizer_file, val_fraction=0.0, shard_tokens=40)
    # counted from the texts: each document's words, plus its end-of-document token
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    lengths = [len(tokenizer.encode(r["text"], add_special_tokens=False).ids) + 1 for r in records]
    assert lengths == [1 + 1, 3 + 1, 9 + 1, 40 + 1, 2 + 1, 150 + 1, 17 + 1, 64 + 1, 5 + 1, 300 + 1]
    check_documents_entry(out, "train", lengths)
    assert lengths_between_eos(all_tokens(out, "train"), 1) == lengths


def test_builtin_index_records_documents_and_old_directories_are_prepared_again(builtin_dir, tmp_path, capsys):
    # the tail split cuts the last play: train ends inside it (a document without its EOS), val holds its end
    for split in ("train", "val"):
        check_documents_entry(builtin_dir, split, lengths_between_eos(all_tokens(builtin_dir, split), 0))
    index = json.loads((builtin_dir / "index.json").read_text())
    assert index["splits"]["train"]["documents"]["count"] == 10 and index["splits"]["val"]["documents"]["count"] == 1
    assert main(["data", "info", str(builtin_dir)]) == 0
    out = capsys.readouterr().out
    mean = index["splits"]["train"]["documents"]["tokens"] / 10
    assert f"documents: 10, mean {mean:,.1f} tokens, longest" in out and "; lengths [" in out

    # a directory prepared before the lengths were recorded: still readable, said so, and the built-in corpus
    # is prepared again to record them
    old = shutil.copytree(builtin_dir, tmp_path / builtin_dir.name)
    for entry in index["splits"].values():
        del entry["documents"]
    (old / "index.json").write_text(json.dumps(index))
    TokenDataset(old, "train")
    assert main(["data", "info", str(old)]) == 0
    assert "documents not recorded (prepared before document lengths were)" in capsys.readouterr().out
    assert ensure_builtin_dataset(tmp_path) == old
    assert "documents" in json.loads((old / "index.json").read_text())["splits"]["train"]
