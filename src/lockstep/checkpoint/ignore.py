"""``load_ignore_keys`` and ``save_ignore_keys``: leave parts of a checkpoint out, with Composer's paths.

Composer names the parts of its checkpoint by ``/``-joined paths (torch uses ``.`` inside names):
``state/model/<parameter or buffer>`` (globs allowed, and a prefix covers everything below it),
``state/optimizers``, ``state/schedulers`` and ``rng``. A callable receives that tree as a dict,
``{"state": {"model": {...}, "optimizers": [...], "schedulers": [...]}, "rng": [...]}``, and may
delete or change entries in place.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable
from typing import Any

IgnoreKeys = list[str] | Callable[[dict[str, Any]], None] | None
_WHOLE = ("state/optimizers", "state/schedulers", "rng")
MODEL = "state/model"


def check(value: Any) -> IgnoreKeys:
    """``load_ignore_keys`` as given, checked; an error names what is accepted."""
    if value is None or callable(value):
        return value
    if isinstance(value, str) or not all(isinstance(k, str) for k in value):
        raise TypeError("load_ignore_keys must be a list of paths such as ['state/model/head.*', 'rng'], "
                        "or a function that edits the checkpoint's dict")
    for key in value:
        path = key.strip("/")
        if not (path == MODEL or path.startswith(MODEL + "/") or path in _WHOLE or path in ("state", "*")):
            raise ValueError(f"load_ignore_keys has {key!r}: lockstep checkpoints hold 'state/model/<name>' "
                             f"(globs allowed), 'state/optimizers', 'state/schedulers' and 'rng'")
    return list(value)


def apply(ignore: IgnoreKeys, model: dict[str, Any], optimizers: list[Any] | None,
          schedulers: list[Any] | None, rngs: list[Any] | None) -> dict[str, Any]:
    """The Composer-shaped tree of what is left to load: ``tree['state']['model']`` and so on;
    a part that was left out is missing from it."""
    tree: dict[str, Any] = {"state": {"model": dict(model)}}
    if optimizers is not None:
        tree["state"]["optimizers"] = optimizers
    if schedulers is not None:
        tree["state"]["schedulers"] = schedulers
    if rngs is not None:
        tree["rng"] = rngs
    if callable(ignore):
        ignore(tree)
        return tree
    for pattern in ignore or []:
        pattern = pattern.strip("/")
        if pattern in ("state", "*"):
            tree["state"] = {}
            continue
        if pattern in _WHOLE:
            parent, _, leaf = pattern.rpartition("/")
            (tree["state"] if parent else tree).pop(leaf, None)
            continue
        names = tree["state"].get("model", {})
        for name in [n for n in names if _covers(pattern, f"{MODEL}/{n}")]:
            del names[name]
    return tree


def _covers(pattern: str, path: str) -> bool:
    return pattern == MODEL or fnmatch.fnmatchcase(path, pattern)


def check_save(value: Any) -> IgnoreKeys:
    """``save_ignore_keys`` as given, checked: a list of globs or a function (Composer's)."""
    if value is None or callable(value):
        return value
    if isinstance(value, str) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"save_ignore_keys={value!r}: give a list of paths such as ['state/model/head.*', 'rng'], "
                        f"or a function that edits the checkpoint's dict in place")
    return list(value) or None


def remove_for_save(ignore: IgnoreKeys, tree: dict[str, Any]) -> None:
    """Apply ``save_ignore_keys`` to ``tree`` (``{'state': {...}, 'rng': [...]}``) in place, as
    Composer does: each glob is matched against every path of the tree, ``/``-joined (list items
    by index, so ``state/optimizers/0/state/*/exp_avg_sq``), and what matches is removed with
    everything below it; a glob that matches nothing is warned about. A function edits ``tree``.
    ``tree`` must not share containers with live state (see :func:`copy_containers`)."""
    if callable(ignore):
        ignore(tree)
        return
    paths: list[str] = []
    _paths(tree, "", paths)
    remove: set[str] = set()
    for pattern in ignore or []:
        matched = fnmatch.filter(paths, pattern)
        if not matched:
            warnings.warn(f"save_ignore_keys: {pattern!r} matches nothing in the checkpoint", stacklevel=2)
        remove.update(matched)
    for path in remove:  # list items are marked first and dropped together, so indices hold meanwhile
        _mark(tree, path.split("/"))
    _drop_marked(tree)


def copy_containers(obj: Any) -> Any:
    """``obj`` with every dict and list copied and the rest (tensors, numbers) shared: removing
    from the copy leaves the live state (an optimizer's per-parameter dicts) untouched."""
    if isinstance(obj, dict):
        copied = type(obj)() if type(obj) is not dict else {}
        copied.update((k, copy_containers(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module state_dict's versions, which load_state_dict reads
            copied._metadata = obj._metadata  # type: ignore[attr-defined]
        return copied
    if isinstance(obj, list):
        return [copy_containers(v) for v in obj]
    return obj


_REMOVED = object()


def _paths(obj: Any, prefix: str, out: list[str]) -> None:
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        path = f"{prefix}/{key}" if prefix else str(key)
        out.append(path)
        _paths(value, path, out)


def _mark(tree: Any, parts: list[str]) -> None:
    """Remove the entry at ``parts`` from a dict, or mark it in a list; nothing when an entry
    above it is gone already. Keys match as strings (optimizer state is keyed by int)."""
    parent = tree
    for part in parts[:-1]:
        key = _key(parent, part)
        if key is None:
            return
        parent = parent[key]
    key = _key(parent, parts[-1])
    if isinstance(parent, list) and key is not None:
        parent[key] = _REMOVED
    elif key is not None:
        del parent[key]


def _drop_marked(obj: Any) -> None:
    if isinstance(obj, dict):
        for value in obj.values():
            _drop_marked(value)
    elif isinstance(obj, list):
        obj[:] = [v for v in obj if v is not _REMOVED]
        for value in obj:
            _drop_marked(value)


def _key(obj: Any, part: str) -> Any:
    if isinstance(obj, dict):
        return next((k for k in obj if str(k) == part), None)
    if isinstance(obj, list) and part.isdigit() and int(part) < len(obj) and obj[int(part)] is not _REMOVED:
        return int(part)
    return None
