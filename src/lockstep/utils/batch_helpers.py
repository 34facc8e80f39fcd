"""Reading and replacing one part of a batch, as Composer's ``composer.utils.batch_helpers``.

A key is an index (``0``), a mapping key (``'input_ids'``), an attribute name (``'x'`` of a
namedtuple or any object), a sequence of those (several parts at once), a function (``get(batch)``;
for setting, ``set(batch, value) -> batch``) or a ``(get, set)`` pair of functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["batch_get", "batch_set"]


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

