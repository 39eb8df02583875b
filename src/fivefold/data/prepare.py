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
import socket
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fivefold import faults
from fivefold.config import shown
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
# Where a text may be cut into pieces that tokenize to the tokens of the whole (`_text_pieces`), for the byte-level
# pre-tokenizers (GPT-2's regex and Llama 3's): after a newline between two non-space characters, or before a
# whitespace character other than a line break that follows a non-space character. Whitespace here is the
# tokenizers' (Unicode White_Space: `CUT_SPACES` and the line breaks); Python's \s adds \x1c-\x1f, which the
# tokenizers count as punctuation, so `(?<=\S)` is only stricter than theirs. Not a cut: after a newline that follows
# whitespace ("end  \nNext", "end\n\nNext", "end\r\nNext"), where GPT-2's `\s+(?!\S)` keeps the newline apart from
# the whitespace before it in the whole text and not at a piece's end; nor before a line break, which Llama 3 joins
# to the punctuation before it.
CUT_SPACES = " \t\x0b\x0c\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
LINE_START = re.compile(r"(?<=\S)\n(?=\S)")  # cut after the newline
SPACE_CUT = re.compile(rf"(?<=\S)[{CUT_SPACES}]")  # cut before the whitespace character
# the longest piece of a document that the tokenizer trainer is given at once: its memory grows about 100 times a
# piece's characters, per thread (a piece is cut as `_text_pieces` cuts, so it holds up to twice as many)
TRAIN_PIECE_CHARS = 1 << 16

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


# yields (input file number, line or row number in that file (0 for a whole file), document text); the text is
# None for a null JSONL value or Parquet row, "" for an empty one (both counted and skipped)
DocumentStream = Callable[[], Iterator[tuple[int, int, str | None]]]


def _cut_points(text: str, max_chars: int) -> Iterator[tuple[int, str]]:
    """Where `_text_pieces` cuts `text`: (offset, how), how being "line", "space" or "hard"."""
    start = 0
    while len(text) - start > max_chars:
        low, high = start + max_chars, min(len(text), start + 2 * max_chars)
        found = LINE_START.search(text, low, high + 1)
        if found is not None:
            start, how = found.end(), "line"
        elif (found := SPACE_CUT.search(text, low, high)) is not None:
            start, how = found.start(), "space"
        else:
            start, how = low, "hard"
        yield start, how


def _text_pieces(text: str, max_chars: int) -> list[str]:
    """`text` cut into pieces of `max_chars` to `2 * max_chars` characters (the last may be shorter): just after
    the first newline after `max_chars` that stands between two non-space characters (a line ending in a
    non-space character, the next starting with one); failing that, just before the first whitespace character
    after `max_chars` that is not a line break and follows a non-space character; failing both (a run of
    `2 * max_chars` characters without either), at `max_chars`.

    The first two (`LINE_START`, `SPACE_CUT`) are cuts that byte-level pre-tokenizers (GPT-2's regex, Llama 3's)
    always split at and that leave each piece's end tokenized as in the whole, so the pieces encode to exactly the
    tokens of the whole; a tokenizer that prepends a space to every input (SentencePiece-style Metaspace) adds one
    at each cut. The third ("hard") may change the tokens at the cut. Only documents longer than `max_chars` are cut,
    so the memory of tokenizing (and of training a tokenizer) stays bounded whatever the lines.
    """
    pieces, start = [], 0
    for end, _ in _cut_points(text, max_chars):
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


def _long_line_warning(text: str, where: str, max_chars: int, line_numbers: bool) -> str | None:
    """A warning when `_text_pieces(text, max_chars)` cuts `text` inside lines over `max_chars` characters, or
    anywhere at a cut that may change the tokens (None otherwise): how many long lines, the longest (its line
    number with `line_numbers`), and whether the cuts are exact (before spaces) or may change the tokens (runs
    without a space). A cut inside a shorter line before a space (lines that end in whitespace, which no line cut
    follows) is exact and said nothing of."""
    lines: dict[int, int] = {}  # start -> end of each line over max_chars cut inside
    hard = 0
    for end, how in _cut_points(text, max_chars):
        if how != "line":
            hard += how == "hard"
            start = text.rfind("\n", 0, end) + 1
            line_end = text.find("\n", end)
            line_end = len(text) if line_end < 0 else line_end
            if line_end - start > max_chars:
                lines[start] = line_end
    if not lines and not hard:
        return None
    if not lines:
        return (f"warning: {where}: {hard:,} cut(s) of its text into pieces of {max_chars:,} to {2 * max_chars:,} "
                f"characters found no line break between two non-space characters and no space after one within "
                f"{2 * max_chars:,} characters, so they fall where the tokens may differ from those of the whole text")
    start = max(lines, key=lambda k: lines[k] - k)
    at = f" (line {text.count(chr(10), 0, start) + 1})" if line_numbers else ""
    how = (f"runs of over {2 * max_chars:,} characters without a space are cut every {max_chars:,} characters, and "
           "the tokens at those cuts may differ from those of the whole line" if hard else
           "they are tokenized in pieces cut before spaces (the same tokens for a byte-level tokenizer)")
    return (f"warning: {where}: {len(lines)} line(s) over {max_chars:,} characters, the longest "
            f"{lines[start] - start:,}{at}: {how}")


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
    for file_number, _, text in stream():
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
    warn: Progress | None = None,
) -> Path:
    """Tokenize the documents of `stream` into a prepared directory at `out` (see prepare_dataset). `warn`: where
    warnings go (default: `progress`). SIGTERM and SIGHUP stop it as Ctrl-C does (`faults.StopSignal`), the staging
    directory removed."""
    with faults.stop_signals_interrupt(f"nothing was written to {Path(out).expanduser()}"):
        return _prepare_documents(stream, sources, num_files, out, tokenizer_path=tokenizer_path,
                                  vocab_size=vocab_size, val_fraction=val_fraction, shard_tokens=shard_tokens,
                                  overwrite=overwrite, eos_token=eos_token, eos_given=eos_given, progress=progress,
                                  warn=progress if warn is None else warn)


def _where(source: dict[str, Any], number: int) -> str:
    """`input PATH`, with the JSONL line or Parquet row `number` (0: the whole file)."""
    unit = {"jsonl": "line", "parquet": "row"}.get(source.get("kind", ""))
    return f"input {source.get('path')}" + (f", {unit} {number}" if unit and number else "")


def _prepare_documents(stream: DocumentStream, sources: list[dict[str, Any]], num_files: int, out: Path, *,
                       tokenizer_path: Path | None, vocab_size: int, val_fraction: float, shard_tokens: int,
                       overwrite: bool, eos_token: str | None, eos_given: bool, progress: Progress | None,
                       warn: Progress | None) -> Path:
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
        if eos_given and eos_token != EOS_TOKEN:  # before the tokenizer is trained, not after
            raise DataError(f"--eos-token {shown(eos_token)} names the end-of-text token of a tokenizer given with "
                            f"--tokenizer; the tokenizer that prepare trains has its own, {EOS_TOKEN}: add "
                            "--tokenizer, or drop --eos-token")

    # pass 1: read everything once, so that bad input fails now, and count for the split
    document_chars = array("q")
    skipped = {"empty": 0, "null": 0}
    has_text = False  # some document holds more than whitespace
    for file_number, number, text in stream():
        if not text:
            skipped["empty" if text is not None else "null"] += 1
            continue
        document_chars.append(len(text))
        has_text = has_text or not text.isspace()
        if len(text) > ENCODE_BATCH_CHARS and warn is not None:
            line = _long_line_warning(text, _where(sources[file_number], number), ENCODE_BATCH_CHARS,
                                      sources[file_number].get("kind") == "txt")
            if line is not None:
                warn(line)
        if report.due():
            report(f"reading: file {file_number + 1}/{num_files}, {len(document_chars):,} documents")
    were = _skipped_text(skipped)
    if not document_chars:
        raise DataError(f"empty corpus: the {num_files} input file(s) hold no text" + (f" ({were})" if were else ""))
    if not has_text:
        raise DataError(f"empty corpus: the {len(document_chars):,} document(s) of the {num_files} input file(s) hold "
                        "only whitespace (spaces, tabs, line breaks); a corpus needs some text to train a tokenizer "
                        "and a model on")
    report(f"read {num_files} file(s): {len(document_chars):,} documents, {sum(document_chars):,} characters"
           + (f"; {were}" if were else ""))
    plan = plan_split(document_chars, val_fraction)

    # pass 2: the tokenizer, trained on pieces of at most about TRAIN_PIECE_CHARS characters (bounded memory)
    if tokenizer is None:
        report(f"training a byte-level BPE tokenizer (vocab size {vocab_size})")
        tokenizer = train_bpe_tokenizer(
            (piece for _, _, text in stream() if text for piece in _text_pieces(text, TRAIN_PIECE_CHARS)), vocab_size
        )
    eos_id, eos_text = find_eos(tokenizer, str(tokenizer_path or "trained"), eos_token, eos_given)
    vocab = tokenizer_vocab_size(tokenizer)
    dtype = token_dtype(vocab)

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out)
    staging = out.parent / f".{out.name}.tmp-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"
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
        index["skipped_documents"] = skipped
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        publish(staging, out, overwrite)
    except BaseException as e:
        placed = not staging.exists()  # publish renamed it to `out`: a stop it deferred came after the swap
        with faults.stop_signals_deferred():  # a second Ctrl-C or SIGTERM waits: no half-removed staging directory
            shutil.rmtree(staging, ignore_errors=True)
        if placed and isinstance(e, faults.StopSignal):
            raise faults.StopSignal(e.signum, f"{out} was written in full before it stopped") from None
        raise
    return out


def _skipped_text(skipped: dict[str, int]) -> str:
    """`skipped 3 empty and 1 null document(s)` ("" when none was)."""
    parts = [f"{count:,} {kind}" for kind, count in skipped.items() if count]
    return f"skipped {' and '.join(parts)} document(s)" if parts else ""


def _host_tag() -> str:
    """This host's name as it goes into a staging directory's name (letters, digits, dots and dashes)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: a process of another user holds that id
        return True
    return True


def _remove_stale_staging(out: Path) -> None:
    """Remove the staging directories (`.NAME.tmp-HOST-PID-XXXXXXXX`) that an earlier prepare of `out` on this host
    left when it was killed (SIGKILL, a power cut): those whose process is gone. One whose process lives, or of
    another host (a shared file system), or named in the older `.NAME.tmp-PID-XXXXXXXX` form, is left alone."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.tmp-{re.escape(_host_tag())}-(\d+)-[0-9a-f]{{8}}")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is not None and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))) \
                and entry.is_dir() and not entry.is_symlink():
            with faults.stop_signals_deferred():  # removed whole, or (killed) left whole for the next prepare
                shutil.rmtree(entry, ignore_errors=True)


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
    warn: Progress | None = None,
) -> Path:
    """Tokenize `.txt`, `.jsonl` and `.parquet` files (or directories of them) into a prepared
    directory at `out` and return `out`.

    Each `.txt` file is one document; each JSONL line / Parquet row is one document, its text in `field`; empty
    documents and null values are counted and skipped, and a corpus of only whitespace is refused.
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
    if field != "text" and all(source.kind == "txt" for source in found):
        raise DataError(f"--field {shown(field)} names the text of JSONL lines and Parquet rows, but the inputs are "
                        ".txt files only (each file is one document) and would ignore it; drop --field")

    def stream() -> Iterator[tuple[int, int, str | None]]:
        for file_number, source in enumerate(found):
            for number, text in read_documents(source, field):
                yield file_number, number, text

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
        warn=warn,
    )
