"""Data: tokenize text into token shards (`prepare_dataset`), read them (`TokenDataset`), and sample
deterministic batches (`BatchSampler`, `val_batches`); the built-in corpus (`ensure_builtin_dataset`)."""

from fivefold.data.builtin import builtin_documents, default_cache_dir, ensure_builtin_dataset
from fivefold.data.dataset import TokenDataset, read_index
from fivefold.data.format import DataError, token_dtype
from fivefold.data.prepare import load_tokenizer, prepare_dataset
from fivefold.data.sampler import BatchSampler, val_batches

__all__ = [
    "BatchSampler",
    "DataError",
    "TokenDataset",
    "builtin_documents",
    "default_cache_dir",
    "ensure_builtin_dataset",
    "load_tokenizer",
    "prepare_dataset",
    "read_index",
    "token_dtype",
    "val_batches",
]
