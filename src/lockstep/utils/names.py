"""Composer's name formatting: ``format_name_with_dist`` and ``format_name_with_dist_and_time``
fill ``{run_name}``, ``{rank}`` and friends (and the timestamp's fields) into a name, leaving any
field they do not know as it is."""

from __future__ import annotations

import string
from typing import Any

from lockstep import dist
from lockstep.time import Timestamp

_PLACES = {"rank": dist.get_global_rank, "local_rank": dist.get_local_rank, "world_size": dist.get_world_size,
           "local_world_size": dist.get_local_world_size, "node_rank": dist.get_node_rank}


def partial_format(text: str, *args: Any, **kwargs: Any) -> str:
    """``text.format(*args, **kwargs)`` where a field with no value stays ``{field}`` (its spec too)."""
    parts, position = [], 0
    for literal, field, spec, conversion in string.Formatter().parse(text):
        parts.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is None:
            continue
        numbered = field or str(position)
        position += field == ""
        name = numbered.split(".")[0].split("[")[0]
        known = int(name) < len(args) if name.isdigit() else name in kwargs
        rest = (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
        # a field with no value stays as written ('{}' too), for a later format to fill
        parts.append("{" + numbered + rest + "}" if known else "{{" + field + rest + "}}")
    return "".join(parts).format(*args, **kwargs)


def _places() -> dict[str, Any]:
    found = {}
    for name, value in _PLACES.items():
        try:
            found[name] = value()
        except dist.MissingEnvironmentError:  # as in Composer: a value the environment lacks is left out
            pass
    return found


def format_name_with_dist(format_str: str, run_name: str, **extra_format_kwargs: object) -> str:
    """``format_str`` with ``{run_name}``, ``{rank}``, ``{local_rank}``, ``{world_size}``,
    ``{local_world_size}``, ``{node_rank}`` and the extra fields filled in."""
    return partial_format(format_str, run_name=run_name, **_places(), **extra_format_kwargs)


def format_name_with_dist_and_time(format_str: str, run_name: str, timestamp: Timestamp,
                                   **extra_format_kwargs: object) -> str:
    """:func:`format_name_with_dist` and the timestamp's ``{epoch}``, ``{batch}``,
    ``{batch_in_epoch}``, ``{sample}``, ``{sample_in_epoch}``, ``{token}``, ``{token_in_epoch}``
    and ``{total_wct}``, ``{epoch_wct}``, ``{batch_wct}`` (seconds)."""
    times = {name: int(getattr(timestamp, name)) for name in
             ("epoch", "batch", "batch_in_epoch", "sample", "sample_in_epoch", "token", "token_in_epoch")}
    times.update({name: getattr(timestamp, name).total_seconds() for name in ("total_wct", "epoch_wct", "batch_wct")})
    return partial_format(format_str, run_name=run_name, **times, **_places(), **extra_format_kwargs)
