"""``load_ignore_keys``: leave parts of a checkpoint out when loading ``load_path``, with Composer's paths.

Composer names the parts of its checkpoint by ``/``-joined paths (torch uses ``.`` inside names):
``state/model/<parameter or buffer>`` (globs allowed, and a prefix covers everything below it),
``state/optimizers``, ``state/schedulers`` and ``rng``. A callable receives that tree as a dict,
``{"state": {"model": {...}, "optimizers": [...], "schedulers": [...]}, "rng": [...]}``, and may
delete or change entries in place.
"""

from __future__ import annotations

import fnmatch
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
