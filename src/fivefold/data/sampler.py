"""Deterministic batches of training windows, the same whatever the data-parallel layout.

Global sample `g` of the run (`g = step * global_batch_size + row`) is window
`permutation(seed, epoch)[g % num_windows]` with `epoch = g // num_windows`: every epoch visits every
window once in a seeded random order. A batch is therefore a pure function of (seed, step): data-parallel
rank `r` of `dp` reads rows `[r * B / dp, (r + 1) * B / dp)` of the global batch, so ranks read disjoint
rows whose union is the global batch, the global batch of a step is the same for any `dp`, and a run
resumed at step `k` reads exactly what it would have read at step `k`.

The data position is counted in samples (windows) consumed, not in steps: a run resumed at step `k` after
`n` samples with another global batch size `B'` reads samples `n + (step - k) * B' + row`, so it continues at the
sample where the checkpoint stopped, without repeating or skipping any (`start_step`, `start_sample`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from fivefold.config import shown
from fivefold.data.dataset import TokenDataset
from fivefold.data.format import DataError

if TYPE_CHECKING:
    import torch

CACHED_EPOCHS = 2  # a batch spans at most two epochs unless the dataset is smaller than a batch


def _positive_int(name: str, value: int) -> int:
    if not isinstance(value, int | np.integer) or value < 1:
        raise DataError(f"{name} {shown(value)}: must be a positive integer")
    return int(value)


def _to_tensors(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) as int64 tensors [rows, seq_len] from windows [rows, seq_len + 1]."""
    import torch  # imported here so that `fivefold data prepare` starts without loading torch

    tokens = torch.from_numpy(windows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _rank_rows(batch_size: int, dp_rank: int, dp_size: int) -> range:
    """The rows of a batch of `batch_size` that data-parallel rank `dp_rank` of `dp_size` reads."""
    dp_size = _positive_int("dp_size", dp_size)
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank}: must be in [0, {dp_size})")
    if batch_size % dp_size:
        raise DataError(
            f"batch size {batch_size} is not divisible by dp_size {dp_size}; "
            f"use a multiple of {dp_size}, e.g. {max(dp_size, batch_size // dp_size * dp_size)}"
        )
    per_rank = batch_size // dp_size
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)


class BatchSampler:
    """Global batches of `global_batch_size` windows of `seq_len` tokens, a function of (seed, step)."""

    def __init__(self, dataset: TokenDataset, seq_len: int, global_batch_size: int, seed: int = 0,
                 start_step: int = 0, start_sample: int | None = None):
        self.dataset = dataset
        self.seq_len = _positive_int("seq_len", seq_len)
        self.global_batch_size = _positive_int("global_batch_size", global_batch_size)
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise DataError(f"seed {shown(seed)}: must be a non-negative integer")
        self.seed = int(seed)
        self.num_windows = dataset.require_windows(self.seq_len)
        self._permutations: dict[int, np.ndarray] = {}
        for name, value in (("start_step", start_step), ("start_sample", start_sample)):
            if value is not None and (not isinstance(value, int | np.integer) or value < 0):
                raise DataError(f"{name} {shown(value)}: must be a non-negative integer")
        self.start_step = int(start_step)
        # samples consumed before start_step; by default as many steps of this batch size
        self.start_sample = self.start_step * self.global_batch_size if start_sample is None else int(start_sample)

    def samples_before(self, step: int) -> int:
        """Samples (windows) consumed by the steps before `step`: the data position a checkpoint records."""
        if not isinstance(step, int | np.integer) or step < self.start_step:
            raise DataError(f"step {shown(step)}: must be an integer >= {self.start_step} (the step this run's data "
                            "position starts at)")
        return self.start_sample + (int(step) - self.start_step) * self.global_batch_size

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The order in which epoch `epoch` visits the windows (cached for the latest epochs)."""
        if epoch not in self._permutations:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(self.num_windows)
            self._permutations[epoch] = order.astype(np.uint32) if self.num_windows < 2**32 else order
            while len(self._permutations) > CACHED_EPOCHS:
                del self._permutations[min(self._permutations)]
        return self._permutations[epoch]

    def epoch(self, step: int) -> float:
        """How many epochs have been read before `step` (fractional)."""
        return self.samples_before(step) / self.num_windows

    def window_indices(self, step: int, rows: range | None = None) -> np.ndarray:
        """The window index of each of `rows` (default: all) of the global batch of `step`."""
        rows = range(self.global_batch_size) if rows is None else rows
        samples = self.samples_before(step) + np.arange(rows.start, rows.stop, dtype=np.int64)
        epochs, positions = np.divmod(samples, self.num_windows)
        indices = np.empty(len(samples), dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            indices[chosen] = self.epoch_permutation(int(epoch))[positions[chosen]]
        return indices

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 tensors [global_batch_size, seq_len], of step `step`."""
        return _to_tensors(self.dataset.windows(self.window_indices(step), self.seq_len))

    def step_batch(self, step: int, dp_rank: int, dp_size: int, eos_id: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`rank_batch(step, dp_rank, dp_size)` and the number of targets of the whole global batch that are
        trained: all of them, or under document masking (`eos_id` given) all but those whose input is the
        end-of-document token (no prediction across a document boundary, the convention of
        `models.masking.mask_document_targets`). That count is read from the data, so every rank knows it without
        a collective: with `eos_id` each rank reads the global batch once and keeps its rows."""
        total = self.global_batch_size * self.seq_len
        if eos_id is None:
            return *self.rank_batch(step, dp_rank, dp_size), total
        windows = self.dataset.windows(self.window_indices(step), self.seq_len)
        trained = total - int(np.count_nonzero(windows[:, :-1] == eos_id))
        rows = _rank_rows(self.global_batch_size, dp_rank, dp_size)
        return *_to_tensors(windows[rows.start:rows.stop]), trained

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [dp_rank * B / dp_size, (dp_rank + 1) * B / dp_size) of global_batch(step)."""
        rows = _rank_rows(self.global_batch_size, dp_rank, dp_size)
        return _to_tensors(self.dataset.windows(self.window_indices(step, rows), self.seq_len))


def val_window_indices(num_windows: int, batch_size: int, n_batches: int) -> np.ndarray:
    """`batch_size * n_batches` window indices spread evenly over the split (repeating when it is smaller)."""
    total = batch_size * n_batches
    if total <= num_windows:
        return np.arange(total, dtype=np.int64) * num_windows // total
    return np.arange(total, dtype=np.int64) % num_windows


def val_batches(
    dataset_val: TokenDataset,
    seq_len: int,
    batch_size: int,
    n_batches: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` fixed validation batches (the same at every evaluation) of `batch_size` windows spread
    evenly over the split; with `dp_size > 1`, this rank's rows of each batch."""
    seq_len = _positive_int("seq_len", seq_len)
    batch_size = _positive_int("batch_size", batch_size)
    n_batches = _positive_int("n_batches", n_batches)
    rows = _rank_rows(batch_size, dp_rank, dp_size)
    indices = val_window_indices(dataset_val.require_windows(seq_len), batch_size, n_batches)
    for batch in range(n_batches):
        chosen = indices[batch * batch_size + rows.start : batch * batch_size + rows.stop]
        yield _to_tensors(dataset_val.windows(chosen, seq_len))
