"""The on-disk format of a prepared token directory (written by `prepare`, read by `TokenDataset`).

A prepared directory holds:
  index.json          what is below, with sizes and checksums
  tokenizer.json      the Hugging Face `tokenizers` tokenizer that produced the tokens
  train_000000.bin    raw little-endian token ids (dtype in the index), documents each followed by EOS
  val_000000.bin      the same for the held-out validation split
"""

from __future__ import annotations

import re

import numpy as np

from fivefold.config import ConfigError

INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_NAME = "fivefold-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


class DataError(ConfigError):
    """A bad input file, field, tokenizer or prepared directory; the message names it and the rule."""


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
