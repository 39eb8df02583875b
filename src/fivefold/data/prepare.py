"""Tokenize `.txt`, `.jsonl` and `.parquet` files into token shards (`fivefold data prepare`).

Three passes over the inputs: the first reads every document (so that bad input fails before any
expensive work, and to count documents and characters for the validation split), the second trains a
byte-level BPE tokenizer when none is given, the third tokenizes into `train_*.bin` / `val_*.bin`
shards. Everything is written into a hidden temporary directory beside the output and renamed into
place at the end, so an interrupted prepare never leaves a half-written output directory.

The inputs are read by `sources`, the tokenizer comes from `tokenizer`, the shards and the output directory are
written by `shards`; this module splits the corpus and runs the passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
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
    TOKENIZER_FILE,
    DataError,
    dtype_name,
    hf_eos_token,
    resolve_tokenizer_file,
    token_dtype,
    tokenizer_fingerprint,
)
from fivefold.data.shards import (  # noqa: F401  (re-exported: the prepare step's public names)
    OutputExistsError,
    ShardWriter,
    check_output,
    is_prepared_directory,
    publish,
)
from fivefold.data.sources import SUPPORTED_EXTENSIONS, Source, find_sources, read_documents  # noqa: F401
from fivefold.data.tokenizer import (  # noqa: F401
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    check_vocab_size,
    find_eos,
    load_tokenizer,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
)

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


def _tokenize_documents(stream: DocumentStream, plan: SplitPlan, tokenizer, writers: dict, eos_id: int, num_files: int,
                        report: _Reporter) -> int:
    """Pass 3: tokenize every document into the train and val shard writers, as `plan` splits them (whole
    documents, or the tail of the corpus cut at a line), in batches of about ENCODE_BATCH_CHARS; the tokens."""
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
    return n_tokens


def _index(staging: Path, dtype, vocab: int, eos_id: int, eos_text: str, tokenizer_path: Path | None,
           vocab_size: int, method: str, val_fraction: float, splits: dict, sources: list[dict[str, Any]]) -> dict:
    """The prepared directory's index (`INDEX_FILE`): format, dtype, vocabulary, end-of-document token, the
    tokenizer file's source and hashes, the split and its shards, the sources."""
    return {
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
        "split": {"method": method, "val_fraction": val_fraction},
        "splits": splits,
        "sources": sources,
    }


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
    eos_given: bool = False,
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
        find_eos(tokenizer, str(tokenizer_path), eos_token, eos_given)
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
    eos_id, eos_text = find_eos(tokenizer, str(tokenizer_path or "trained"), eos_token, eos_given)
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
        writers = {split: ShardWriter(staging, split, dtype, shard_tokens, eos_id) for split in ("train", "val")}

        # pass 3: tokenize
        _tokenize_documents(stream, plan, tokenizer, writers, eos_id, num_files, report)
        splits = {split: writer.close() for split, writer in writers.items()}
        report(
            f"tokenized {num_files} file(s): {splits['train']['num_tokens']:,} train tokens, "
            f"{splits['val']['num_tokens']:,} val tokens"
        )
        index = _index(staging, dtype, vocab, eos_id, eos_text, tokenizer_path, vocab_size, plan.method,
                       val_fraction, splits, sources)
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
    if not str(out):
        raise DataError("--out '' is empty; give the directory to write, e.g. --out tokens")
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
        eos_given=eos_token is not None,  # the user's --eos-token, not the model's own (its tokenizer_config)
        eos_token=eos_token or (hf_eos_token(tokenizer) if tokenizer is not None and Path(tokenizer).is_dir()
                                else None),
        progress=progress,
    )
