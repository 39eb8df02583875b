"""Read a prepared token directory: `TokenDataset` memory-maps the shards of one split and cuts them into
training windows.

Window `i` of length `seq_len` reads `seq_len + 1` consecutive tokens: the model sees the first
`seq_len` as inputs and is trained to predict the last `seq_len` (the next token at each position).
Windows start every `seq_len` tokens (they do not overlap, apart from the one extra target token) and
never cross a shard boundary, so a shard of `n` tokens holds `(n - 1) // seq_len` windows.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from fivefold.config import file_sha256, shown
from fivefold.data.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    SPLITS,
    TOKENIZER_FILE,
    DataError,
    check_index,
    document_lengths,
    dtype_from_name,
    inside_name,
    tokenizer_fingerprint,
)
from fivefold.flops import DocumentLengths


def read_index(path: str | Path, tokenizer: bool = False) -> dict[str, Any]:
    """The parsed index.json of a prepared directory, checked as a whole (format, version, then `check_index`: every
    field readers use) and, with `tokenizer`, its tokenizer file (`check_tokenizer`; what trains on the data or
    describes it asks for that): before anything reads a shard."""
    path = Path(path).expanduser()
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise DataError(
            f"{path}: no {INDEX_FILE}; is it a directory written by "
            f"`fivefold data prepare INPUT --out {path}`?"
        )
    try:
        index = json.loads(index_path.read_text("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{index_path}: unreadable ({e}); prepare the directory again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise DataError(f"{index_path}: not a fivefold token index (format should be {shown(FORMAT_NAME)})")
    version = index.get("version")
    if version != FORMAT_VERSION:
        raise DataError(
            f"{index_path}: format version {shown(version)}, this fivefold reads version {FORMAT_VERSION}; "
            "prepare the directory again"
        )
    check_index(index, path)
    if tokenizer:
        check_tokenizer(path, index)
    return index


def check_tokenizer(path: Path, index: dict[str, Any]) -> Path:
    """The tokenizer file that index.json names: present, of the sha256 the index records (if it records one), and
    readable by `tokenizers`; else a DataError naming it. Returns its path."""
    file = inside_name(path, index["tokenizer"].get("file", TOKENIZER_FILE), "tokenizer.file")
    if not file.is_file():
        raise DataError(f"{path}: no tokenizer file {file.name} ({INDEX_FILE} names it as the tokenizer of the "
                        "tokens); prepare the directory again")
    try:
        sha = file_sha256(file)
    except OSError as e:
        raise DataError(f"{file}: unreadable ({e.strerror or e}); prepare the directory again") from None
    want = index["tokenizer"].get("sha256")
    if want and sha != want:
        raise DataError(f"{file}: sha256 {sha[:16]}... differs from {INDEX_FILE} tokenizer.sha256 {want[:16]}... "
                        "(modified or corrupt); prepare the directory again")
    _check_tokenizer_readable(str(file.resolve()), sha)
    return file


@lru_cache(maxsize=8)
def _check_tokenizer_readable(file: str, sha256: str) -> None:
    """A DataError unless `tokenizers` reads the file (once per content: the train and val splits share it)."""
    from fivefold.data.tokenizer import load_tokenizer

    try:
        load_tokenizer(file)
    except DataError as e:
        raise DataError(f"{e}; prepare the directory again") from None


class TokenDataset:
    """One split ("train" or "val") of a prepared directory, memory-mapped.

    Opening checks the index (format, version) and that every shard exists with the size the index
    gives; `verify()` also checks the shards' sha256.
    """

    def __init__(self, path: str | Path, split: str = "train"):
        self.path = Path(path).expanduser()
        if split not in SPLITS:
            raise DataError(f"split {shown(split)}: unknown; valid: {', '.join(SPLITS)}")
        self.split = split
        self.index = read_index(self.path)
        self.dtype = dtype_from_name(self.index["dtype"])
        self.vocab_size: int = int(self.index["vocab_size"])
        # the end-of-document token, after every document (None in an index that does not record it)
        self.eos_id: int | None = int(self.index["eos_id"]) if self.index.get("eos_id") is not None else None
        entry = self.index["splits"][split]
        self.shard_entries: list[dict[str, Any]] = [s for s in entry.get("shards", []) if s["num_tokens"] > 0]
        if not self.shard_entries:
            hint = (" (prepared with --val-fraction 0?); `fivefold train` scores the validation split (at step 0, "
                    "every train.eval_every steps and at the end): prepare the data again with --val-fraction above "
                    "0, e.g. 0.01") if split == "val" else ""
            raise DataError(f"{self.path}: the {split} split holds no tokens{hint}")
        self.shards: list[np.memmap] = []
        for shard in self.shard_entries:
            file = inside_name(self.path, shard["file"], "shard file")
            n = int(shard["num_tokens"])
            expected = n * self.dtype.itemsize
            if not file.is_file():
                raise DataError(
                    f"{file}: missing shard ({INDEX_FILE} lists it with {n:,} tokens); prepare again"
                )
            size = file.stat().st_size
            if size != expected:
                raise DataError(
                    f"{file}: {size:,} bytes, but {INDEX_FILE} lists {n:,} tokens x "
                    f"{self.dtype.itemsize} bytes "
                    f"= {expected:,} bytes (truncated or modified); prepare again"
                )
            self.shards.append(np.memmap(file, dtype=self.dtype, mode="r", shape=(n,)))
        self.shard_tokens = np.array([s.size for s in self.shards], dtype=np.int64)
        self.num_tokens: int = int(self.shard_tokens.sum())

    @property
    def document_lengths(self) -> DocumentLengths | None:
        """The split's documents' lengths as the index records them (None for a directory prepared before)."""
        return document_lengths(self.index, self.split)

    def check_tokenizer(self) -> None:
        """A DataError unless the tokenizer file the index names is present, of its recorded sha256 and readable."""
        check_tokenizer(self.path, self.index)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.index.get("tokenizer", {}).get("file", TOKENIZER_FILE)

    @property
    def tokenizer_fingerprint(self) -> str:
        """The fingerprint of the tokenizer that produced the tokens: from the index, or for indexes written
        before it was recorded, computed from the directory's tokenizer.json."""
        stored = self.index.get("tokenizer", {}).get("fingerprint")
        return stored if stored else tokenizer_fingerprint(self.tokenizer_path)

    @property
    def corpus_fingerprint(self) -> str | None:
        """A fingerprint of the split's tokens, from what the index already records: the dtype and each non-empty
        shard's token count and sha256, in order (not the directory's path or the shards' file names: the same
        prepared directory moved or copied keeps it). None for an index that records no shard checksums."""
        if any(not shard.get("sha256") for shard in self.shard_entries):
            return None
        import hashlib

        listed = [self.index["dtype"], [[int(s["num_tokens"]), str(s["sha256"])] for s in self.shard_entries]]
        return hashlib.sha256(json.dumps(listed, separators=(",", ":")).encode()).hexdigest()

    def __repr__(self) -> str:
        return (
            f"TokenDataset({shown(str(self.path))}, split={shown(self.split)}: {self.num_tokens:,} tokens in "
            f"{len(self.shards)} shard(s), vocab {self.vocab_size})"
        )

    def check_model_vocab(self, model_vocab_size: int, fixed_by: Path | None = None) -> None:
        """Raise a DataError unless a model with `model_vocab_size` embeddings can take every token id: the
        index's vocabulary, and the largest id of every shard (each read once). `fixed_by`: the Hugging Face
        directory whose weights fix the model's vocabulary (the fix is then the data, not the config)."""
        if model_vocab_size < self.vocab_size:
            fix = (f"prepare the data with the model's tokenizer (`fivefold data prepare FILES --tokenizer {fixed_by} "
                   "--out DIR`): its weights fix the vocabulary") if fixed_by is not None else \
                f"set model.vocab_size >= {self.vocab_size}"
            raise DataError(
                f"model.vocab_size {model_vocab_size} is smaller than the vocabulary of {self.path} "
                f"({self.vocab_size} ids, {self.tokenizer_path.name}); {fix}"
            )
        limit = min(model_vocab_size, self.vocab_size)
        for entry, shard in zip(self.shard_entries, self.shards, strict=True):
            top = max(int(shard[i:i + (1 << 24)].max()) for i in range(0, shard.size, 1 << 24))
            if top >= limit:
                raise DataError(
                    f"{self.path / entry['file']}: holds token id {top}, but ids must be below {limit} "
                    f"(model.vocab_size = {model_vocab_size}, the dataset's vocabulary {self.vocab_size}); the shard "
                    "is damaged or from another tokenizer: prepare the data again"
                )

    def verify(self) -> None:
        """Check every shard's sha256 against the index (reads all the shards)."""
        for shard in self.shard_entries:
            file = self.path / shard["file"]
            if file_sha256(file) != shard.get("sha256"):
                raise DataError(
                    f"{file}: sha256 differs from {INDEX_FILE} (modified or corrupt); prepare again"
                )

    @lru_cache(maxsize=8)  # noqa: B019 (a handful of seq_lens per dataset; the dataset lives for the run)
    def _window_ends(self, seq_len: int) -> np.ndarray:
        """Cumulative window counts over the shards."""
        return np.cumsum(np.maximum(self.shard_tokens - 1, 0) // seq_len)

    def num_windows(self, seq_len: int) -> int:
        """How many windows of `seq_len` (+1 target) tokens the split holds."""
        _check_seq_len(seq_len)
        return int(self._window_ends(seq_len)[-1])

    def require_windows(self, seq_len: int) -> int:
        """num_windows(seq_len), or a DataError saying what seq_len would fit when it is zero."""
        n = self.num_windows(seq_len)
        if n == 0:
            longest = int(self.shard_tokens.max()) - 1
            fit = f"seq_len <= {longest} would fit" if longest >= 1 else "no seq_len fits; add text"
            raise DataError(
                f"{self.path} ({self.split} split): {self.num_tokens:,} tokens (longest shard "
                f"{longest + 1:,}) hold no window of seq_len {seq_len} + 1 tokens; {fit}"
            )
        return n

    def window(self, i: int, seq_len: int) -> np.ndarray:
        """Window `i`: `seq_len + 1` tokens as int64 (inputs are [:-1], targets [1:])."""
        ends = self._window_ends(seq_len)
        if not 0 <= i < int(ends[-1]):
            raise IndexError(
                f"window {i} out of range: {self.split} split has {int(ends[-1])} windows of {seq_len}"
            )
        shard = int(np.searchsorted(ends, i, side="right"))
        local = i - (int(ends[shard - 1]) if shard > 0 else 0)
        start = local * seq_len
        return np.asarray(self.shards[shard][start : start + seq_len + 1], dtype=np.int64)

    def windows(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows for each of `indices`, stacked as int64 [len(indices), seq_len + 1]."""
        out = np.empty((len(indices), seq_len + 1), dtype=np.int64)
        for row, i in enumerate(indices):
            out[row] = self.window(int(i), seq_len)
        return out


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int | np.integer) or seq_len < 1:
        raise DataError(f"seq_len {shown(seq_len)}: must be a positive integer")
