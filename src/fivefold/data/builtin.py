"""The built-in corpus: ten Shakespeare plays shipped in the package (see corpus/NOTICE.md), prepared on
first use into a cache directory so that training runs with no data configured."""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from fivefold.config import ConfigError, check_writable_dir
from fivefold.data.dataset import TokenDataset, read_index
from fivefold.data.format import DataError, document_lengths
from fivefold.data.prepare import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    Progress,
    check_vocab_size,
    is_prepared_directory,
    prepare_documents,
)

BUILTIN_CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.txt.gz"
BUILTIN_NAME = "shakespeare-v1"
PLAY_SEPARATOR = "\f\n"  # a form-feed line between plays (see scripts/build_corpus.py)


def default_cache_dir() -> Path:
    """Where prepared built-in data lives: `$FIVEFOLD_CACHE` if set, else `~/.cache/fivefold`."""
    configured = os.environ.get("FIVEFOLD_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "fivefold"


def builtin_documents() -> list[str]:
    """The plays of the built-in corpus, one string each."""
    text = gzip.decompress(BUILTIN_CORPUS.read_bytes()).decode("utf-8")
    return [play for play in text.split(PLAY_SEPARATOR) if play]


def builtin_dataset_dir(cache_dir: Path, vocab_size: int, val_fraction: float) -> Path:
    """`<cache>/shakespeare-v1-bpe2048` (with `-val<F>` when the validation fraction is not the default)."""
    name = f"{BUILTIN_NAME}-bpe{vocab_size}"
    if val_fraction != DEFAULT_VAL_FRACTION:
        name += f"-val{val_fraction:g}"
    return Path(cache_dir).expanduser() / name


def _corpus_sha256() -> str:
    return hashlib.sha256(BUILTIN_CORPUS.read_bytes()).hexdigest()


def _is_ready(path: Path, vocab_size: int, val_fraction: float, corpus_sha256: str) -> bool:
    """True when `path` holds the built-in corpus prepared with these settings, shards intact."""
    try:
        index = read_index(path)
        sources = index.get("sources", [])
        if (
            index["tokenizer"].get("trained_vocab_size") != vocab_size
            or index["split"]["val_fraction"] != val_fraction
            or len(sources) != 1
            or sources[0].get("sha256") != corpus_sha256
            or document_lengths(index) is None  # prepared before document lengths were recorded
        ):
            return False
        for split in ("train", "val") if val_fraction > 0 else ("train",):
            TokenDataset(path, split).verify()
    except (DataError, KeyError, TypeError):
        return False
    return True


def ensure_builtin_dataset(
    cache_dir: Path | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: Progress | None = None,
) -> Path:
    """The prepared directory of the built-in corpus under `cache_dir` (default: default_cache_dir()),
    preparing it first if it is missing or not intact. Safe to call from several processes at once: each
    prepares privately and the first to finish publishes its result."""
    check_vocab_size(vocab_size)
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    target = builtin_dataset_dir(cache_dir, vocab_size, val_fraction)
    corpus_sha256 = _corpus_sha256()
    if _is_ready(target, vocab_size, val_fraction, corpus_sha256):
        return target
    where = "FIVEFOLD_CACHE" if cache_dir == default_cache_dir() and os.environ.get("FIVEFOLD_CACHE") else \
        "the cache directory (FIVEFOLD_CACHE sets it)"
    try:  # it is prepared there now: the cache must be a directory that can be written
        check_writable_dir(cache_dir, where)
    except ConfigError as e:
        raise DataError(f"{e}; the built-in corpus is tokenized into it once") from None
    replace = target.is_dir() and any(target.iterdir())
    if replace and not is_prepared_directory(target):
        raise DataError(f"{target}: holds files that are not a prepared token directory; move them away")
    documents = builtin_documents()

    def stream() -> Iterator[tuple[int, int, str | None]]:
        for play in documents:
            yield 0, 0, play

    source = {
        "path": f"builtin:{BUILTIN_CORPUS.name}",
        "kind": "txt.gz",
        "size": BUILTIN_CORPUS.stat().st_size,
        "sha256": corpus_sha256,
        "documents": "one per play",
    }
    try:
        prepare_documents(
            stream,
            [source],
            1,
            target,
            tokenizer_path=None,
            vocab_size=vocab_size,
            val_fraction=val_fraction,
            shard_tokens=DEFAULT_SHARD_TOKENS,
            overwrite=replace,
            progress=progress,
        )
    except DataError:
        if not _is_ready(
            target, vocab_size, val_fraction, corpus_sha256
        ):  # else another process published it
            raise
    return target
