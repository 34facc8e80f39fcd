"""Batches: counting their samples, splitting them into microbatches, mapping their tensors,
reading and replacing one of their parts (Composer's ``batch_get``/``batch_set``); and
``ensure_tuple``, Composer's way of taking one object, a sequence or None.

A batch is a tensor, or a tuple, list, namedtuple or dict of batches; other leaves (strings,
numbers) are carried along unchanged. ``lockstep.Model`` teaches the Trainer any other type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it, keeping each container's type."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(mapped)
        except TypeError:  # a mapping type that cannot be built from a dict
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def batch_num_samples(batch: Any) -> int:
    """Size of the first dimension of the first tensor found in a tensor/tuple/list/dict batch."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("cannot count samples in a 0-d tensor batch; give the batch a leading dimension")
        return batch.shape[0]
    # list and tuple first: the usual batch, and a cheaper check than the Mapping ABC's
    items = batch if isinstance(batch, (list, tuple)) else batch.values() if isinstance(batch, Mapping) else None
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
    return [take(batch, i * microbatch_size, min(n, (i + 1) * microbatch_size)) for i in range(chunks)]


def take(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start`` to ``stop`` of a batch."""
    return map_tensors(batch, lambda t: t[start:stop])


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on ``device``."""
    if device.type == "cpu":
        return batch  # dataloaders already yield CPU tensors; skip the tree walk
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating-point tensors in ``dtype``."""
    return map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)

def ensure_tuple(x: Any) -> tuple[Any, ...]:
    """``x`` as a tuple: None is empty, a list, tuple or range becomes one, a dict its values,
    anything else a tuple of itself."""
    if x is None:
        return ()
    if isinstance(x, (str, bytes, bytearray)):
        return (x,)
    if isinstance(x, (tuple, list, range)):
        return tuple(x)
    if isinstance(x, dict):
        return tuple(x.values())
    return (x,)


def _is_pair(key: Any) -> bool:
    return (isinstance(key, Sequence) and not isinstance(key, str) and len(key) == 2
            and all(callable(f) for f in key))


def batch_get(batch: Any, key: Any) -> Any:
    """The part of ``batch`` that ``key`` names (several parts as a tuple for a sequence of keys)."""
    if _is_pair(key):
        return key[0](batch)
    if callable(key):
        return key(batch)
    try:
        return batch[key]
    except (IndexError, TypeError, KeyError) as by_item:
        if isinstance(key, Sequence) and not isinstance(key, str):
            return tuple(batch_get(batch, k) for k in key)
        if isinstance(key, str) and hasattr(batch, key):
            return getattr(batch, key)
        raise by_item


def batch_set(batch: Any, key: Any, value: Any) -> Any:
    """``batch`` with the part that ``key`` names replaced by ``value``: in place where the batch
    allows it, else a new batch (a tuple, a namedtuple); the batch is returned either way. For a
    sequence of keys, ``value`` is a sequence of as many values."""
    if _is_pair(key):
        return key[1](batch, value)
    if callable(key):
        return key(batch, value)
    if isinstance(key, Sequence) and not isinstance(key, str):
        if not isinstance(value, Sequence) or len(value) != len(key):
            raise ValueError(f"batch_set: {len(key)} keys need as many values, got {value!r}")
        for k, v in zip(key, value):
            batch = batch_set(batch, k, v)
        return batch
    if isinstance(batch, tuple):
        return _set_in_tuple(batch, key, value)
    try:
        batch[key]  # only replace what is there: a missing key is an error, not a new entry
    except TypeError:  # no item access: an attribute
        if not hasattr(batch, key):
            raise AttributeError(f"batch_set: the batch ({type(batch).__name__}) has no item or attribute "
                                 f"{key!r}") from None
        setattr(batch, key, value)
        return batch
    batch[key] = value
    return batch


def _set_in_tuple(batch: tuple[Any, ...], key: Any, value: Any) -> tuple[Any, ...]:
    if isinstance(key, str) and hasattr(batch, "_replace"):  # a namedtuple, by field name
        return batch._replace(**{key: value})  # type: ignore[attr-defined]
    items = list(batch)
    items[key] = value
    return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
