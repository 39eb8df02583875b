"""Tokenize `.txt`, `.jsonl` and `.parquet` files into token shards (`fivefold data prepare`).

Three passes over the inputs: the first reads every document (so that bad input fails before any
expensive work, and to count documents and characters for the validation split), the second trains a
byte-level BPE tokenizer when none is given, the third tokenizes into `train_*.bin` / `val_*.bin`
shards. Everything is written into a hidden temporary directory beside the output and renamed into
place at the end, so an interrupted prepare never leaves a half-written output directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fivefold.data.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    SHARD_NAME,
    TOKENIZER_FILE,
    DataError,
    dtype_name,
    hf_eos_token,
    resolve_tokenizer_file,
    shard_file_name,
    token_dtype,
    tokenizer_fingerprint,
)

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".parquet")
EOS_TOKEN = "<|endoftext|>"
# end-of-text tokens of common tokenizers (GPT-2, Llama 3, Llama 2 / Mistral, Gemma), tried in this order
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BYTE_LEVEL_MIN_VOCAB = 257  # 256 byte symbols + the end-of-text token
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 100_000_000
MAX_VAL_FRACTION = 0.5
# hold out whole documents only when at least this many land in the validation split
MIN_VAL_DOCUMENTS = 10
SPLIT_SEED = 0  # the document split is a fixed function of the corpus, not of any run seed
ENCODE_BATCH_CHARS = 1 << 20  # characters per tokenizer call: large enough to amortise, small in memory
PROGRESS_INTERVAL_S = 2.0
LINE_START = re.compile(r"\n(?=\S)")  # a newline followed by a non-space character

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Source:
    """One input file: where it is and how to read documents out of it."""

    path: Path
    kind: str  # "txt" | "jsonl" | "parquet"
    size: int
    mtime: float

    def describe(self, field: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "path": str(self.path),
            "kind": self.kind,
            "size": self.size,
            "mtime": self.mtime,
        }
        if self.kind != "txt":
            entry["field"] = field
        return entry


# ---------------------------------------------------------------------------------------------------
# Finding and reading inputs


def find_sources(inputs: Sequence[str | Path]) -> list[Source]:
    """The input files named by `inputs` (files, or directories searched recursively), in a fixed order.

    Files in directories whose extension is not supported are skipped; a file named explicitly must have
    a supported extension.
    """
    if not inputs:
        raise DataError("no inputs given; name one or more .txt, .jsonl or .parquet files or directories")
    valid = ", ".join(SUPPORTED_EXTENSIONS)
    found: dict[Path, Source] = {}
    for given in inputs:
        path = Path(given).expanduser()
        if not path.exists():
            raise DataError(f"input {path}: no such file or directory")
        if path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix.lower() in SUPPORTED_EXTENSIONS
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not files:
                raise DataError(f"input directory {path}: no input files found (looked for {valid})")
        else:
            if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
                raise DataError(
                    f"input {path}: unknown extension {path.suffix or '(none)'!r}; valid: {valid}"
                )
            files = [path]
        for file in files:
            if not os.access(file, os.R_OK):
                raise DataError(f"input {file}: not readable (permission denied)")
            stat = file.stat()
            resolved = file.resolve()
            found.setdefault(resolved, Source(resolved, file.suffix.lower()[1:], stat.st_size, stat.st_mtime))
    return list(found.values())


def read_documents(source: Source, field: str) -> Iterator[str]:
    """The documents of one input file: a whole `.txt` file, or the `field` of each JSONL line or
    Parquet row. Empty documents are yielded too (the caller skips them)."""
    if source.kind == "txt":
        yield _read_text(source.path)
    elif source.kind == "jsonl":
        yield from _read_jsonl(source.path, field)
    elif source.kind == "parquet":
        yield from _read_parquet(source.path, field)
    else:
        raise DataError(f"input {source.path}: unknown kind {source.kind!r}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"input {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise DataError(f"input {path}: cannot read ({e.strerror})") from None


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"input {path}, line {line_number}: invalid JSON ({e.msg} at column {e.colno})"
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"input {path}, line {line_number}: expected a JSON object with field {field!r}, "
                        f"got a JSON {type(record).__name__}"
                    )
                if field not in record:
                    fields = ", ".join(repr(k) for k in list(record)[:10]) or "none"
                    raise DataError(
                        f"input {path}, line {line_number}: no field {field!r} "
                        f"(fields on this line: {fields}; "
                        "choose one with --field)"
                    )
                value = record[field]
                if not isinstance(value, str):
                    raise DataError(
                        f"input {path}, line {line_number}: field {field!r} must be a string, "
                        f"got {type(value).__name__}"
                    )
                yield value
    except UnicodeDecodeError as e:
        raise DataError(f"input {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise DataError(f"input {path}: cannot read ({e.strerror})") from None


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"input {path}: reading Parquet needs pyarrow (pip install pyarrow, or fivefold[parquet])"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"input {path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        columns = ", ".join(repr(n) for n in schema.names[:20]) or "none"
        raise DataError(f"input {path}: no column {field!r} (columns: {columns}; choose one with --field)")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"input {path}: column {field!r} must hold strings, it holds {column_type}")
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:  # a null row is no document
                yield value


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` read from a `tokenizer.json` file, or a DataError saying why not."""
    from tokenizers import Tokenizer

    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"tokenizer {path}: no such file (give a Hugging Face tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass for any parse error
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"tokenizer {path}: not a readable tokenizer.json ({first_line})") from None


def find_eos(tokenizer, where: str, eos_token: str | None = None) -> tuple[int, str]:
    """The (id, text) of the tokenizer's end-of-text token: `eos_token` if given, else the first of
    EOS_CANDIDATES that the vocabulary holds."""
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id), token
    if eos_token:
        raise DataError(f"tokenizer {where}: has no token {eos_token!r} (--eos-token)")
    raise DataError(
        f"tokenizer {where}: has none of the end-of-text tokens {', '.join(EOS_CANDIDATES)}; "
        "name its end-of-text token with --eos-token"
    )


def tokenizer_vocab_size(tokenizer) -> int:
    """One more than the largest token id, so that every id the tokenizer emits is below it."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < BYTE_LEVEL_MIN_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE tokenizer needs at least "
            f"{BYTE_LEVEL_MIN_VOCAB} ids (256 bytes + {EOS_TOKEN}); try {BYTE_LEVEL_MIN_VOCAB}, 512 or 2048"
        )


def train_bpe_tokenizer(documents: Iterator[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization) trained on `documents`, with
    `<|endoftext|>` as id 0. The vocabulary may end up smaller than `vocab_size` on a tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


# ---------------------------------------------------------------------------------------------------
# Validation split


@dataclass
class SplitPlan:
    """Which text goes to the validation split.

    method "documents": the documents whose mask entry is True; "tail": everything from character
    `tail_offset` of document `tail_document` on (moved back to the start of its line); "none": nothing.
    """

    method: str
    val_documents: np.ndarray | None = None
    tail_document: int = 0
    tail_offset: int = 0


def plan_split(document_chars: Sequence[int], val_fraction: float) -> SplitPlan:
    """Hold out whole documents when at least MIN_VAL_DOCUMENTS would be held out, else the last
    `val_fraction` of the text (by characters). A fixed function of the corpus."""
    n_documents = len(document_chars)
    if val_fraction == 0 or n_documents == 0:
        return SplitPlan("none")
    n_val = round(n_documents * val_fraction)
    if n_val >= MIN_VAL_DOCUMENTS:
        mask = np.zeros(n_documents, dtype=bool)
        mask[np.random.default_rng(SPLIT_SEED).choice(n_documents, size=n_val, replace=False)] = True
        return SplitPlan("documents", val_documents=mask)
    chars = np.asarray(document_chars, dtype=np.int64)
    start = int(np.floor(chars.sum() * (1.0 - val_fraction)))
    ends = np.cumsum(chars)
    doc = int(np.searchsorted(ends, start, side="right"))
    if doc >= n_documents:  # rounding left nothing to hold out: hold out the last character
        doc, start = n_documents - 1, int(ends[-1]) - 1
    offset = start - (int(ends[doc - 1]) if doc > 0 else 0)
    return SplitPlan("tail", tail_document=doc, tail_offset=offset)


def split_at_line(text: str, offset: int, keep_head: bool) -> int:
    """Where to cut a document for the tail validation split: the start of the line holding character
    `offset`, so that the cut falls between lines; `offset` itself when that would leave nothing before
    the cut and `keep_head` (the head is all the training split has)."""
    line_start = text.rfind("\n", 0, offset) + 1
    return offset if line_start == 0 and keep_head else line_start


# ---------------------------------------------------------------------------------------------------
# Writing shards


class ShardWriter:
    """Appends token ids to `<split>_NNNNNN.bin` files of at most `shard_tokens` tokens each, hashing as
    it writes."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.num_tokens = 0
        self.num_documents = 0
        self._file = None
        self._hash = None
        self._in_shard = 0

    def _open_next(self) -> None:
        self._close_current()
        name = shard_file_name(self.split, len(self.shards))
        self._file = open(self.directory / name, "wb")
        self._hash = hashlib.sha256()
        self._in_shard = 0
        self.shards.append({"file": name, "num_tokens": 0, "sha256": ""})

    def _close_current(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards[-1]["num_tokens"] = self._in_shard
            self.shards[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None or self._in_shard == self.shard_tokens:
                self._open_next()
            take = min(ids.size, self.shard_tokens - self._in_shard)
            data = ids[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._in_shard += take
            self.num_tokens += take
            ids = ids[take:]

    def close(self) -> dict[str, Any]:
        self._close_current()
        return {"num_tokens": self.num_tokens, "num_documents": self.num_documents, "shards": self.shards}


# ---------------------------------------------------------------------------------------------------
# Output directory


class OutputExistsError(DataError):
    """The output directory appeared (or was not empty) when the finished output was to be moved in."""


def is_prepared_directory(path: Path) -> bool:
    """True when `path` holds an index.json written by prepare and nothing but prepare's files."""
    index_path = path / INDEX_FILE
    try:
        index = json.loads(index_path.read_text("utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        return False
    return all(
        entry.is_file() and (entry.name in (INDEX_FILE, TOKENIZER_FILE) or SHARD_NAME.match(entry.name))
        for entry in path.iterdir()
    )


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an output that is a file, or a non-empty directory unless `overwrite` and it is a previous
    prepare output (anything else is never deleted)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise DataError(
            f"--out {out}: directory is not empty; pass --overwrite to replace a previous prepare output"
        )
    if not is_prepared_directory(out):
        foreign = sorted(
            e.name
            for e in out.iterdir()
            if not (e.is_file() and (e.name in (INDEX_FILE, TOKENIZER_FILE) or SHARD_NAME.match(e.name)))
        )
        what = f"holds {foreign[0]!r}, which is not" if foreign else "has no index.json written by"
        raise DataError(
            f"--out {out}: {what} part of a prepared token directory; refusing to delete it "
            "(choose another --out)"
        )


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Move the finished `staging` directory to `out`, replacing an empty directory, or a previous
    prepare output when `overwrite`."""
    if out.is_dir() and any(out.iterdir()):
        if not overwrite or not is_prepared_directory(out):
            raise OutputExistsError(f"--out {out}: appeared while preparing; left it untouched")
        retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, retired / out.name)
        os.rename(staging, out)
        shutil.rmtree(retired)
        return
    try:
        os.rename(staging, out)  # atomic; replaces an empty directory
    except OSError as e:
        raise OutputExistsError(f"--out {out}: could not move the output into place ({e.strerror})") from None


# ---------------------------------------------------------------------------------------------------
# Prepare


class _Reporter:
    """Throttled progress lines."""

    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.last = time.monotonic()

    def due(self) -> bool:
        """Whether a progress line is due (cheap; call before formatting one)."""
        return self.progress is not None and time.monotonic() - self.last >= PROGRESS_INTERVAL_S

    def __call__(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)
            self.last = time.monotonic()


DocumentStream = Callable[[], Iterator[tuple[int, str]]]  # yields (input file number, document text)


def _text_pieces(text: str, max_chars: int) -> list[str]:
    """`text` cut into pieces of at least `max_chars` characters (the last may be shorter), each cut
    just before a line that starts with a non-space character.

    Such a cut is a pre-tokenization boundary for byte-level (GPT-2, Llama 3 style) tokenizers, so the
    pieces encode to exactly the tokens of the whole; a tokenizer that prepends a space to every input
    (SentencePiece-style Metaspace) adds one at each cut. Only documents longer than `max_chars` are cut.
    """
    pieces, start = [], 0
    while len(text) - start > max_chars:
        line_start = LINE_START.search(text, start + max_chars)
        if line_start is None:
            break
        pieces.append(text[start : line_start.end()])
        start = line_start.end()
    pieces.append(text[start:])
    return pieces


def _encode_into(
    tokenizer, items: list[tuple[str, str, bool]], writers: dict[str, ShardWriter], eos_id: int
) -> int:
    """Encode (split, text, ends_document) items in one tokenizer call and append them to the writers."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode([text for _, text, _ in items], add_special_tokens=False)
    n_tokens = 0
    run_split, run_ids = items[0][0], []
    for (split, _, ends_document), encoding in zip(items, encodings, strict=True):
        if split != run_split:  # write each run of same-split items at once
            writers[run_split].write(np.asarray(run_ids, dtype=np.int64))
            run_split, run_ids = split, []
        run_ids += encoding.ids
        if ends_document:
            run_ids.append(eos_id)
            writers[split].num_documents += 1
        n_tokens += len(encoding.ids) + ends_document
    writers[run_split].write(np.asarray(run_ids, dtype=np.int64))
    return n_tokens


def prepare_documents(
    stream: DocumentStream,
    sources: list[dict[str, Any]],
    num_files: int,
    out: Path,
    *,
    tokenizer_path: Path | None,
    vocab_size: int,
    val_fraction: float,
    shard_tokens: int,
    overwrite: bool,
    eos_token: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Tokenize the documents of `stream` into a prepared directory at `out` (see prepare_dataset)."""
    report = _Reporter(progress)
    out = Path(out).expanduser()
    if not 0.0 <= val_fraction <= MAX_VAL_FRACTION:
        raise DataError(f"--val-fraction {val_fraction}: must be in [0, {MAX_VAL_FRACTION}]; e.g. 0.05")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DataError(
            f"--shard-tokens {shard_tokens}: must be a positive integer; e.g. {DEFAULT_SHARD_TOKENS}"
        )
    check_output(out, overwrite)
    tokenizer = None
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
        find_eos(tokenizer, str(tokenizer_path), eos_token)
    else:
        check_vocab_size(vocab_size)

    # pass 1: read everything once, so that bad input fails now, and count for the split
    document_chars = array("q")
    for file_number, text in stream():
        if text:
            document_chars.append(len(text))
        if report.due():
            report(f"reading: file {file_number + 1}/{num_files}, {len(document_chars):,} documents")
    if not document_chars:
        raise DataError(f"empty corpus: the {num_files} input file(s) hold no text")
    report(f"read {num_files} file(s): {len(document_chars):,} documents, {sum(document_chars):,} characters")
    plan = plan_split(document_chars, val_fraction)

    # pass 2: the tokenizer
    if tokenizer is None:
        report(f"training a byte-level BPE tokenizer (vocab size {vocab_size})")
        tokenizer = train_bpe_tokenizer((text for _, text in stream() if text), vocab_size)
    eos_id, eos_text = find_eos(tokenizer, str(tokenizer_path or "trained"), eos_token)
    vocab = tokenizer_vocab_size(tokenizer)
    dtype = token_dtype(vocab)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()  # not mkdtemp: the output should get the usual permissions
    try:
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, staging / TOKENIZER_FILE)  # the given file, byte for byte
        else:
            tokenizer.save(str(staging / TOKENIZER_FILE))
        writers = {split: ShardWriter(staging, split, dtype, shard_tokens) for split in ("train", "val")}

        # pass 3: tokenize
        items: list[tuple[str, str, bool]] = []
        batch_chars = 0
        n_tokens = 0
        document = 0
        for file_number, text in stream():
            if not text:
                continue
            if plan.method == "documents":
                parts = [("val" if plan.val_documents[document] else "train", text)]
            elif plan.method == "tail" and document >= plan.tail_document:
                cut = (
                    split_at_line(text, plan.tail_offset, document == 0)
                    if document == plan.tail_document
                    else 0
                )
                parts = [("train", text[:cut]), ("val", text[cut:])]
            else:
                parts = [("train", text)]
            parts = [(split, part) for split, part in parts if part]
            for part_number, (split, part) in enumerate(parts):
                pieces = _text_pieces(part, ENCODE_BATCH_CHARS)
                last_part = part_number == len(parts) - 1
                for piece_number, piece in enumerate(pieces):
                    items.append((split, piece, last_part and piece_number == len(pieces) - 1))
                    batch_chars += len(piece)
                    if batch_chars >= ENCODE_BATCH_CHARS:
                        n_tokens += _encode_into(tokenizer, items, writers, eos_id)
                        items, batch_chars = [], 0
                        if report.due():
                            report(f"tokenizing: file {file_number + 1}/{num_files}, {n_tokens:,} tokens")
            document += 1
        if items:
            n_tokens += _encode_into(tokenizer, items, writers, eos_id)
        splits = {split: writer.close() for split, writer in writers.items()}
        report(
            f"tokenized {num_files} file(s): {splits['train']['num_tokens']:,} train tokens, "
            f"{splits['val']['num_tokens']:,} val tokens"
        )
        index = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "dtype": dtype_name(dtype),
            "vocab_size": vocab,
            "eos_id": eos_id,
            "eos_token": eos_text,
            "tokenizer": {
                "file": TOKENIZER_FILE,
                "source": str(Path(tokenizer_path).resolve()) if tokenizer_path is not None else None,
                "trained_vocab_size": None if tokenizer_path is not None else vocab_size,
                "sha256": hashlib.sha256((staging / TOKENIZER_FILE).read_bytes()).hexdigest(),
                "fingerprint": tokenizer_fingerprint(staging / TOKENIZER_FILE),
            },
            "split": {"method": plan.method, "val_fraction": val_fraction},
            "splits": splits,
            "sources": sources,
        }
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        publish(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def prepare_dataset(
    inputs: Sequence[str | Path],
    out: str | Path,
    *,
    tokenizer: str | Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    eos_token: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Tokenize `.txt`, `.jsonl` and `.parquet` files (or directories of them) into a prepared
    directory at `out` and return `out`.

    Each `.txt` file is one document; each JSONL line / Parquet row is one document, its text in `field`.
    Tokens come from the given `tokenizer` (a tokenizer.json, used as-is) or from a byte-level BPE
    tokenizer of `vocab_size` ids trained on the inputs. Every document is followed by the end-of-text
    token. `val_fraction` of the corpus is held out as the validation split. Raises DataError (a
    ConfigError) for bad inputs, leaving any existing `out` untouched.
    """
    if not field:
        raise DataError("--field: must name a JSONL field / Parquet column, e.g. text")
    found = find_sources(inputs)

    def stream() -> Iterator[tuple[int, str]]:
        for file_number, source in enumerate(found):
            for text in read_documents(source, field):
                yield file_number, text

    return prepare_documents(
        stream,
        [source.describe(field) for source in found],
        len(found),
        Path(out),
        tokenizer_path=resolve_tokenizer_file(tokenizer) if tokenizer is not None else None,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        shard_tokens=shard_tokens,
        overwrite=overwrite,
        eos_token=eos_token or (hf_eos_token(tokenizer) if tokenizer is not None and Path(tokenizer).is_dir()
                                else None),
        progress=progress,
    )
