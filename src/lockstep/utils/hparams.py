"""Hyperparameters as loggers take them (Composer's ``composer.utils.auto_log_hparams``): the
arguments of a call as a dict of plain values, and nested dicts flattened to ``a/b/c`` keys and back."""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["convert_flat_dict_to_nested_dict", "convert_nested_dict_to_flat_dict", "extract_hparams"]


def extract_hparams(locals_dict: dict[str, Any]) -> dict[str, Any]:
    """``locals()`` of a call as hyperparameters: numbers, strings, bools and None as they are, an
    enum as its value, an object with ``local_hparams`` as ``{class name: local_hparams}``, a list,
    tuple or dict one level deep, anything else by its class name. Private names, ``self`` and
    classes are left out."""
    return {name: _value(value) for name, value in locals_dict.items()
            if not name.startswith("_") and name != "self" and type(value) is not type}


def _value(obj: Any) -> Any:
    if hasattr(obj, "local_hparams"):
        return {type(obj).__name__: obj.local_hparams}
    if isinstance(obj, (list, tuple)):
        return [_plain(item) for item in obj]
    if isinstance(obj, dict):
        return {key: _plain(item) for key, item in obj.items()}
    return _plain(obj)


def _plain(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)) and not isinstance(obj, enum.Enum):
        return obj
    if isinstance(obj, enum.Enum):
        return obj.value
    return type(obj).__name__


def convert_nested_dict_to_flat_dict(nested_dict: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{'a': {'b': 1}}`` -> ``{'a/b': 1}`` (keys below ``prefix``, when given)."""
    flat: dict[str, Any] = {}
    for key, value in nested_dict.items():
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(convert_nested_dict_to_flat_dict(value, prefix=path))
        else:
            flat[path] = value
    return flat


def convert_flat_dict_to_nested_dict(flat_dict: dict[str, Any]) -> dict[str, Any]:
    """``{'a/b': 1}`` -> ``{'a': {'b': 1}}``."""
    nested: dict[str, Any] = {}
    for path, value in flat_dict.items():
        *parents, leaf = path.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested
