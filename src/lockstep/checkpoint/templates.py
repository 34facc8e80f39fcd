"""Checkpoint name templates: ``ep{epoch}-ba{batch}-rank{rank}.pt`` and friends."""

from __future__ import annotations

import glob
import re
import string
from collections.abc import Callable
from typing import Any

from lockstep import dist
from lockstep.time import Timestamp

PLACE_FIELDS = ("run_name", "rank", "local_rank", "world_size", "local_world_size", "node_rank")
TIME_FIELDS = ("epoch", "batch", "sample", "token")


def fields_of(template: str, name: str) -> set[str]:
    """The fields a template uses; an unknown or positional field is an error naming ``name``."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{name}={template!r} is not a valid template: {e}") from None
    used = {field for _, field, _, _ in parsed if field is not None}
    unknown = used - set(PLACE_FIELDS) - set(TIME_FIELDS)
    if unknown:
        raise ValueError(f"{name}={template!r} uses unknown field(s) {sorted(unknown)}; "
                         f"valid fields: {', '.join('{' + f + '}' for f in PLACE_FIELDS + TIME_FIELDS)}")
    return used


def check_template(template: Any, name: str, *, time_fields: bool = True) -> str:
    """Validate a template once, at Trainer construction."""
    if not isinstance(template, str) or not template:
        raise TypeError(f"{name} must be a non-empty string template, got {template!r}")
    used = fields_of(template, name)
    if not time_fields and used & set(TIME_FIELDS):
        raise ValueError(f"{name}={template!r} cannot use {sorted(used & set(TIME_FIELDS))}: "
                         f"it is fixed for the whole run; only {PLACE_FIELDS} are allowed there")
    return template


def place_values(run_name: str, rank: int | None = None) -> dict[str, Any]:
    """The fields that do not change during a run, for ``rank`` (default: this rank)."""
    return {
        "run_name": run_name,
        "rank": dist.get_global_rank() if rank is None else rank,
        "local_rank": dist.get_local_rank(),
        "world_size": dist.get_world_size(),
        "local_world_size": dist.get_local_world_size(),
        "node_rank": dist.get_node_rank(),
    }


def format_name(template: str, place: dict[str, Any], timestamp: Timestamp | None = None) -> str:
    values = dict(place)
    if timestamp is not None:
        values.update(epoch=timestamp.epoch.value, batch=timestamp.batch.value, sample=timestamp.sample.value,
                      token=timestamp.token.value)
    return template.format(**values)


def glob_of(template: str, place: dict[str, Any]) -> str:
    """A glob of every name ``template`` makes with ``place``'s values (its time fields as ``*``)."""
    return _filled(template, place, glob.escape, "*")[0]


def time_fields(template: str, place: dict[str, Any], name: str) -> dict[str, int] | None:
    """The time fields of ``name`` (``{'epoch': 1, 'batch': 6}``), a name ``template`` made with
    ``place``'s values, in the template's order; None when ``name`` is not one of its names. Two
    ranks' per-rank files of one save have the same time fields."""
    pattern, fields = _filled(template, place, re.escape, r"(\d+)")
    match = re.fullmatch(pattern, name)
    if match is None:
        return None
    values: dict[str, int] = {}
    for field, text in zip(fields, match.groups()):
        if values.setdefault(field, int(text)) != int(text):  # one field written twice, two values
            return None
    return values


def _filled(template: str, place: dict[str, Any], escape: Callable[[str], str],
            wildcard: str) -> tuple[str, list[str]]:
    """``template`` with its text escaped, its place fields filled in and each time field as
    ``wildcard``; and the time fields, in order."""
    parts, fields = [], []
    for literal, field, spec, _ in string.Formatter().parse(template):
        parts.append(escape(literal))
        if field is None:
            continue
        if field in place:
            parts.append(escape(format(place[field], spec or "")))
        else:
            parts.append(wildcard)
            fields.append(field)
    return "".join(parts), fields
