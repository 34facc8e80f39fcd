"""Splitting a device batch into microbatches, and counting the samples in a batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_num_samples(batch: Any) -> int:
    """Size of the first dimension of the first tensor found in a tensor/tuple/list/dict batch."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("cannot count samples in a 0-d tensor batch; give the batch a leading dimension")
        return batch.shape[0]
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else None
    if items is not None:
        for item in items:
            try:
                return batch_num_samples(item)
            except TypeError:
                continue
    raise TypeError(
        f"cannot count the samples in a batch of type {type(batch).__name__}: override "
        f"Model.num_samples and Model.split_batch for it")


def split_batch(batch: Any, microbatch_size: int) -> list[Any]:
    """Split along the first dimension into chunks of ``microbatch_size`` (the last may be smaller).

    Tensors are split; tuples, lists and dicts are split element-wise, keeping their type;
    non-tensor leaves (strings, numbers) are repeated in every microbatch.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch size must be >= 1, got {microbatch_size}")
    n = batch_num_samples(batch)
    chunks = -(-n // microbatch_size)
    return [_take(batch, i * microbatch_size, min(n, (i + 1) * microbatch_size)) for i in range(chunks)]


def take_first(batch: Any, count: int) -> Any:
    """The first ``count`` samples of a batch."""
    return _take(batch, 0, count)


def _take(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        taken = {k: _take(v, start, stop) for k, v in batch.items()}
        try:
            return type(batch)(taken)
        except TypeError:
            return taken
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, start, stop) for v in batch)
    return batch
