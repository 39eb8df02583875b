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

from fivefold.config import ConfigError, shown
from fivefold.flops import DocumentLengths, LengthBin
from fivefold.pathnames import name_inside

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


TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # index.json's dtype names


def dtype_from_name(name: str) -> np.dtype:
    """The little-endian dtype for a name in index.json."""
    if name not in TOKEN_DTYPES:
        raise DataError(f"{INDEX_FILE}: dtype {shown(name)} is not one of {', '.join(TOKEN_DTYPES)}; prepare the "
                        "directory again")
    return TOKEN_DTYPES[name]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def inside_name(directory: Path, name: object, what: str) -> Path:
    """The file `name` of a prepared directory: a DataError unless it is a plain relative name (no absolute path,
    no `..`) inside `directory` (`pathnames.name_inside`); a link the user put there may lead elsewhere (shards
    shared between directories)."""
    path, why = name_inside(directory, name, links_may_leave=True)
    if path is None:
        raise DataError(f"{directory / INDEX_FILE}: {what} {shown(name)} {why}; prepare the directory again")
    return path


def check_index(index: dict, directory: Path) -> None:
    """Check the fields of a prepared directory's index.json that readers use, as a whole: the dtype, the vocabulary
    (it must fit the dtype), the end-of-document id (below the vocabulary), the tokenizer entry, and each split's
    counts and shards (file names inside the directory, token counts that add up). A DataError names the first field
    that is wrong, its value and the rule."""
    where = directory / INDEX_FILE

    def bad(field: str, value: object, rule: str) -> DataError:
        return DataError(f"{where}: {field} = {shown(value)} {rule}; prepare the directory again")

    if index.get("dtype") not in TOKEN_DTYPES:
        raise bad("dtype", index.get("dtype"), f"is not one of {', '.join(TOKEN_DTYPES)}")
    dtype = TOKEN_DTYPES[index["dtype"]]
    top = 1 << (8 * dtype.itemsize)
    vocab = index.get("vocab_size")
    if not _is_int(vocab) or not 1 <= vocab <= top:
        raise bad("vocab_size", vocab, f"must be an integer from 1 to {top:,} (ids of dtype {dtype.name})")
    eos = index.get("eos_id")
    if eos is not None and (not _is_int(eos) or not 0 <= eos < vocab):
        raise bad("eos_id", eos, f"must be an integer id below vocab_size = {vocab}")
    tokenizer = index.get("tokenizer")
    if not isinstance(tokenizer, dict):
        raise bad("tokenizer", tokenizer, "must be a table naming the tokenizer file")
    inside_name(directory, tokenizer.get("file", TOKENIZER_FILE), "tokenizer.file")
    for key in ("sha256", "fingerprint"):
        if tokenizer.get(key) is not None and not isinstance(tokenizer[key], str):
            raise bad(f"tokenizer.{key}", tokenizer[key], "must be a hex string")
    splits = index.get("splits")
    if not isinstance(splits, dict):
        raise bad("splits", splits, "must be a table of the train and val splits")
    for split in SPLITS:
        entry = splits.get(split)
        if not isinstance(entry, dict):
            raise bad(f"splits.{split}", entry, "must be a table with num_tokens and shards")
        for key in ("num_tokens", "num_documents"):
            if key in entry and (not _is_int(entry[key]) or entry[key] < 0):
                raise bad(f"splits.{split}.{key}", entry[key], "must be a non-negative integer")
        shards = entry.get("shards", [])
        if not isinstance(shards, list):
            raise bad(f"splits.{split}.shards", shards, "must be a list of shards")
        for i, shard in enumerate(shards):
            field = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                raise bad(field, shard, "must be a table with file, num_tokens and sha256")
            inside_name(directory, shard.get("file"), f"{field}.file")
            if not _is_int(shard.get("num_tokens")) or shard["num_tokens"] < 0:
                raise bad(f"{field}.num_tokens", shard.get("num_tokens"), "must be a non-negative integer")
            if shard.get("sha256") is not None and not isinstance(shard["sha256"], str):
                raise bad(f"{field}.sha256", shard["sha256"], "must be a hex string")
        total = sum(shard["num_tokens"] for shard in shards)
        if "num_tokens" in entry and entry["num_tokens"] != total:
            raise bad(f"splits.{split}.num_tokens", entry["num_tokens"],
                      f"differs from the sum of its shards' num_tokens ({total:,})")


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
