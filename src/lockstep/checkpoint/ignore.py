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
from collections.abc import Callable, Collection
from typing import Any

IgnoreKeys = list[str] | Callable[[dict[str, Any]], None] | None
_WHOLE = ("state/optimizers", "state/schedulers", "rng")
MODEL = "state/model"
STATEFUL = ("state/callbacks", "state/algorithms", "state/dataset_state")
"""The parts of :mod:`lockstep.checkpoint.stateful`, which paths (and globs) below them name too."""


def check(value: Any) -> IgnoreKeys:
    """``load_ignore_keys`` as given, checked; an error names what is accepted."""
    if value is None or callable(value):
        return value
    if isinstance(value, str) or not all(isinstance(k, str) for k in value):
        raise TypeError("load_ignore_keys must be a list of paths such as ['state/model/head.*', 'rng'], "
                        "or a function that edits the checkpoint's dict")
    for key in value:
        path = key.strip("/")
        if not (path == MODEL or path.startswith(MODEL + "/") or path in _WHOLE or path in ("state", "*")
                or any(path == part or path.startswith(part + "/") for part in STATEFUL)):
            raise ValueError(f"load_ignore_keys has {key!r}: lockstep checkpoints hold 'state/model/<name>' "
                             f"(globs allowed), 'state/optimizers', 'state/schedulers', 'state/callbacks/<name>', "
                             f"'state/algorithms', 'state/dataset_state' and 'rng'")
    return list(value)


def apply(ignore: IgnoreKeys, model: dict[str, Any], optimizers: list[Any] | None,
          schedulers: list[Any] | None, rngs: list[Any] | None,
          stateful: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Composer-shaped tree of what is left to load: ``tree['state']['model']`` and so on
    (``stateful``: the callbacks', algorithms' and dataset's parts); a part that was left out is
    missing from it."""
    tree: dict[str, Any] = {"state": {"model": dict(model), **copy_containers(stateful or {})}}
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
        if any(pattern == part or pattern.startswith(part + "/") for part in STATEFUL):
            remove_for_save([pattern], tree)  # a glob over the paths below, as when saving
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


_EXACT = ("rng", "state/timestamp")
"""What a resumed run needs to continue exactly as an uninterrupted one: its RNG states and its place."""


def check_save_globs(ignore: IgnoreKeys, model_keys: Collection[str], *, weights_only: bool) -> None:
    """At ``Trainer(...)``: a one-line ValueError when the globs of ``save_ignore_keys`` leave every
    model weight out of every checkpoint (``'**'``, ``'state'``, ``'state/model'``, ...), which then
    could neither resume a run nor be loaded; a warning when they leave out what an exact resume
    needs (the RNG states, the timestamp). ``model_keys``: the names of the model's state_dict."""
    if ignore is None or callable(ignore):
        return
    weights = [f"{MODEL}/{k}" for k in model_keys]
    if _left_out(MODEL, ignore) or (weights and all(_left_out(w, ignore) for w in weights)):
        raise ValueError(f"save_ignore_keys={ignore!r} leaves every model weight out of every checkpoint, which "
                         f"then holds nothing to resume or load: name only the parts to leave out, e.g. "
                         f"['state/optimizers', 'rng'], or give no save_folder to save nothing")
    lost = [p for p in _EXACT if _left_out(p, ignore) or any(g.strip("/").startswith(p + "/") for g in ignore)]
    if lost and not weights_only:
        _warn_inexact(repr(ignore), lost, stacklevel=5)  # the caller of Trainer(...)


def _left_out(path: str, globs: list[str]) -> bool:
    """Whether a glob removes ``path``: it matches the path or a part above it."""
    parts = path.split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[:n]), glob) for n in range(1, len(parts) + 1) for glob in globs)


def _warn_inexact(what: str, lost: list[str], stacklevel: int) -> None:
    warnings.warn(f"save_ignore_keys={what} leaves {' and '.join(repr(p) for p in lost)} out of the checkpoints: a run "
                  f"resumed from them does not continue exactly as an uninterrupted one would", stacklevel=stacklevel)


def remove_for_save(ignore: IgnoreKeys, tree: dict[str, Any]) -> None:
    """Apply ``save_ignore_keys`` to ``tree`` (``{'state': {...}, 'rng': [...]}``) in place, as
    Composer does: each glob is matched against every path of the tree, ``/``-joined (list items
    by index, so ``state/optimizers/0/state/*/exp_avg_sq``), and what matches is removed with
    everything below it; a glob that matches nothing is warned about. A function edits ``tree``.
    ``tree`` must not share containers with live state (see :func:`copy_containers`).

    A ValueError when nothing of the model is left (a function's doing: globs that would do it
    are refused at ``Trainer(...)`` by :func:`check_save_globs`), and a warning when a function
    removed what an exact resume needs."""
    what = getattr(ignore, "__name__", repr(ignore)) if callable(ignore) else repr(ignore)
    had = [p for p in _EXACT if _holds(tree, p)]
    if callable(ignore):
        ignore(tree)
    else:
        _remove_globs(ignore or [], tree)
    if not _holds(tree, MODEL):
        raise ValueError(f"save_ignore_keys={what} left no model weight in the checkpoint, which would hold "
                         f"nothing to resume or load: leave state/model in the dict")
    lost = [p for p in had if not _holds(tree, p)]
    if lost and callable(ignore):  # globs were warned about at Trainer(...)
        _warn_inexact(what, lost, stacklevel=3)


def _holds(tree: dict[str, Any], path: str) -> bool:
    """Whether ``tree`` holds something at ``path`` (``state/model``: at least one entry)."""
    node: Any = tree
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return bool(node) if path == MODEL else True


def _remove_globs(ignore: list[str], tree: dict[str, Any]) -> None:
    paths: list[str] = []
    _paths(tree, "", paths)
    remove: set[str] = set()
    for pattern in ignore:
        matched = fnmatch.filter(paths, pattern)
        if not matched:
            warnings.warn(f"save_ignore_keys: {pattern!r} matches nothing in the checkpoint", stacklevel=3)
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
