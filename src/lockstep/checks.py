"""The errors for a value that is not one of the valid ones, written once for every argument."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def _closest(value: Any, valid: list[str]) -> str:
    match = difflib.get_close_matches(str(value), valid, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_choice(name: str, value: Any, choices: Iterable[str], *, also: str = "") -> None:
    """Raise ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}{also}"
                         f"{_closest(value, choices)}")


def check_keys(name: str, given: Iterable[Any], valid: Iterable[str]) -> None:
    """Raise ValueError naming ``name`` if ``given`` holds a key outside ``valid``, with the
    closest valid key for each unknown one."""
    valid = list(valid)
    unknown = sorted({str(k) for k in given} - set(valid))
    if unknown:
        hints = "".join(_closest(k, valid) for k in unknown[:1])
        raise ValueError(f"{name} has unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                         f"{', '.join(valid)}{hints}")


def check_bool(name: str, value: Any) -> None:
    """Raise TypeError naming ``name`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: give True or False")
