"""The output of `fivefold data prepare`: token shards written and hashed as they fill, and the output directory
checked before and published atomically after (a hidden staging directory renamed into place)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fivefold.config import ConfigError, check_writable_dir, shown
from fivefold.data.format import (
    FORMAT_NAME,
    INDEX_FILE,
    SHARD_NAME,
    TOKENIZER_FILE,
    DataError,
    documents_entry,
    shard_file_name,
)
from fivefold.faults import stop_signals_deferred
from fivefold.flops import DocumentLengths


class DocumentCounter:
    """The lengths of the documents in a token stream, read from the stream itself: a document ends at each
    `eos_id` (its length counts that token), and tokens after the last one form a document of their own."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id
        self.lengths = DocumentLengths(())
        self.longest = 0
        self._open = 0  # tokens since the last end-of-document token

    def add(self, ids: np.ndarray) -> None:
        ends = np.flatnonzero(ids == self.eos_id)
        if ends.size:
            lengths = np.diff(ends, prepend=-1)
            lengths[0] += self._open
            self._count(lengths.tolist())
            self._open = int(ids.size - ends[-1] - 1)
        else:
            self._open += int(ids.size)

    def _count(self, lengths: list[int]) -> None:
        self.lengths = self.lengths.merged(DocumentLengths.of(lengths))
        self.longest = max(self.longest, max(lengths))

    def close(self) -> dict[str, Any]:
        """The split's `documents` entry of the index (`format.documents_entry`)."""
        if self._open:
            self._count([self._open])
            self._open = 0
        return documents_entry(self.lengths, self.longest)


class ShardWriter:
    """Appends token ids to `<split>_NNNNNN.bin` files of at most `shard_tokens` tokens each, hashing as
    it writes, and counts the documents' lengths (`DocumentCounter`) when given the end-of-document id."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int, eos_id: int | None = None):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.num_tokens = 0
        self.num_documents = 0
        self.documents = DocumentCounter(eos_id) if eos_id is not None else None
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
        if self.documents is not None:
            self.documents.add(ids)
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
        entry = {"num_tokens": self.num_tokens, "num_documents": self.num_documents, "shards": self.shards}
        return entry | ({"documents": self.documents.close()} if self.documents is not None else {})


# ---------------------------------------------------------------------------------------------------
# Output directory


class OutputExistsError(DataError):
    """The output directory appeared (or was not empty) when the finished output was to be moved in."""


def is_prepared_directory(path: Path) -> bool:
    """True when `path` holds an index.json written by prepare and nothing but prepare's files."""
    index_path = path / INDEX_FILE
    try:
        index = json.loads(index_path.read_text("utf-8"))
    except (OSError, ValueError, RecursionError):
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
    if out.absolute() == Path.cwd().absolute():
        raise DataError(f"--out {out} is the current directory, which the finished output would replace; give a "
                        "directory by its name, e.g. --out tokens")
    try:  # the output is built beside it: that directory must exist or be creatable, and be writable
        check_writable_dir(out.absolute().parent, "--out")
    except ConfigError as e:
        raise DataError(f"--out {out}: {str(e).removeprefix('--out ')}") from None
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
        what = (f"holds {shown(foreign[0])}, which is not part of a prepared token directory" if foreign else
                f"its {INDEX_FILE} is not one that `fivefold data prepare` wrote, so it is no prepared token directory")
        raise DataError(f"--out {out}: {what}; refusing to delete it (choose another --out)")


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Move the finished `staging` directory to `out`, replacing an empty directory, or a previous
    prepare output when `overwrite`."""
    if out.is_dir() and any(out.iterdir()):
        if not overwrite or not is_prepared_directory(out):
            raise OutputExistsError(f"--out {out}: appeared while preparing; left it untouched")
        retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        with stop_signals_deferred():  # the swap and the previous output's removal, not stopped half done
            os.rename(out, retired / out.name)
            os.rename(staging, out)
            shutil.rmtree(retired)
        return
    try:
        os.rename(staging, out)  # atomic; replaces an empty directory
    except OSError as e:
        raise OutputExistsError(f"--out {out}: could not move the output into place ({e.strerror})") from None
