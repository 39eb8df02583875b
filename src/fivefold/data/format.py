"""The on-disk format of a prepared token directory (written by `prepare`, read by `TokenDataset`).

A prepared directory holds:
  index.json          what is below, with sizes and checksums
  tokenizer.json      the Hugging Face `tokenizers` tokenizer that produced the tokens
  train_000000.bin    raw little-endian token ids (dtype in the index), documents each followed by EOS
  val_000000.bin      the same for the held-out validation split

Each split's entry in index.json may hold `documents` (directories prepared before it was recorded lack it): the
document boundaries are the `eos_id` tokens of the stream, and `documents` gives their count, total tokens, mean
and longest length, and the histogram of lengths (tokens, each document's end-of-document token included) in
power-of-two bins with the moments that price attention (`fivefold.flops.DocumentLengths`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from fivefold.config import ConfigError
from fivefold.flops import DocumentLengths, LengthBin

INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_NAME = "fivefold-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


class DataError(ConfigError):
    """A bad input file, field, tokenizer or prepared directory; the message names it and the rule."""


def documents_entry(lengths: DocumentLengths, longest: int) -> dict:
    """A split's `documents` entry of index.json: how documents are delimited, their count, tokens, mean and
    longest length, and the power-of-two histogram of lengths (each bin: lengths from..to, its documents and the
    sums of the lengths, their squares and cubes)."""
    return {
        "boundary": "eos_id",
        "count": lengths.documents,
        "tokens": lengths.tokens,
        "mean": round(lengths.mean, 3),
        "longest": longest,
        "bins": "power of two: lengths 2^k .. 2^(k+1) - 1",
        "histogram": [{"from": b.start, "to": 2 * b.start - 1, "documents": b.documents, "tokens": b.tokens,
                       "tokens_squared": b.tokens_squared, "tokens_cubed": b.tokens_cubed} for b in lengths.bins],
    }


def document_lengths(index: dict, split: str = "train") -> DocumentLengths | None:
    """The documents' lengths of a split as index.json records them, or None for a directory prepared before they
    were recorded."""
    entry = index.get("splits", {}).get(split, {}).get("documents")
    if not entry:
        return None
    try:
        return DocumentLengths(tuple(LengthBin(int(b["from"]), int(b["documents"]), int(b["tokens"]),
                                               int(b["tokens_squared"]), int(b["tokens_cubed"]))
                                     for b in entry["histogram"]))
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{INDEX_FILE}: the {split} split's documents histogram is damaged ({e!r}); prepare the "
                        "directory again") from None


def _size(n: int) -> str:
    """1, 2, ..., 512, 1K, 2K, ..., 1M (powers of two)."""
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def histogram_line(lengths: DocumentLengths) -> str:
    """The histogram compactly: each non-empty bin as `[from,to) count`."""
    return ", ".join(f"[{_size(b.start)},{_size(2 * b.start)}) {b.documents:,}" for b in lengths.bins)


SHARD_NAME = re.compile(r"^(train|val)_\d{6}\.bin$")


def shard_file_name(split: str, number: int) -> str:
    """`train_000000.bin`, `val_000003.bin`, ..."""
    return f"{split}_{number:06d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype holding every id of a vocabulary of `vocab_size` ids."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def dtype_name(dtype: np.dtype) -> str:
    """`uint16` or `uint32`, as written in index.json."""
    return np.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype:
    """The little-endian dtype for a name in index.json."""
    return {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}[name]


def tokenizer_fingerprint(tokenizer_json: str | Path) -> str:
    """sha256 of a tokenizer.json's canonical content (keys sorted, no whitespace): two files that describe the
    same tokenizer get the same fingerprint whatever their formatting."""
    text = Path(tokenizer_json).read_text(encoding="utf-8")
    try:
        canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except json.JSONDecodeError as e:
        raise DataError(f"tokenizer {tokenizer_json}: not valid JSON ({e})") from None
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def resolve_tokenizer_file(path: str | Path) -> Path:
    """A tokenizer.json given directly or inside a Hugging Face model directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        inner = path / TOKENIZER_FILE
        if not inner.is_file():
            raise DataError(
                f"tokenizer {path}: a directory without {TOKENIZER_FILE}; give a Hugging Face model directory "
                f"that holds one (a fast tokenizer), or the path of a {TOKENIZER_FILE}"
            )
        return inner
    return path


def hf_eos_token(model_dir: str | Path) -> str | None:
    """The eos_token named by a Hugging Face directory's tokenizer_config.json, if any."""
    config = Path(model_dir) / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (json.JSONDecodeError, AttributeError, RecursionError):
        return None
    if isinstance(eos, dict):  # an AddedToken written out
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None
