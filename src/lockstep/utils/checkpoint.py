"""Composer's ``composer.utils.checkpoint`` names that scripts and tests use: :func:`glob_filter`
and :class:`PartialFilePath`; checkpoints themselves are in :mod:`lockstep.checkpoint`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lockstep.checkpoint.ignore import remove_for_save
from lockstep.utils.names import format_name_with_dist, format_name_with_dist_and_time

__all__ = ["PartialFilePath", "glob_filter"]


def glob_filter(exclude_globs: list[str]) -> Callable[[dict[str, Any]], None]:
    """A function that removes, in place, every part of a checkpoint dict whose ``/``-joined path
    matches one of ``exclude_globs`` (warning for a glob that matches nothing)."""
    def remove(state_dict: dict[str, Any]) -> None:
        remove_for_save(list(exclude_globs), state_dict)
    return remove


class PartialFilePath:
    """A file name template, filled from the run's state: ``{run_name}``, ``{rank}``, ``{epoch}``, ..."""

    def __init__(self, filename: str, folder: str | Path = "") -> None:
        self.folder, self.filename = str(folder), str(filename)

    def format(self, state: Any, keep_placeholders: bool = False) -> str:
        """The path for ``state`` (``keep_placeholders``: leave ``{epoch}`` and the other time fields as they are)."""
        path = str(Path(self.folder) / self.filename) if self.folder else self.filename
        if keep_placeholders:
            return format_name_with_dist(path, state.run_name)
        return format_name_with_dist_and_time(path, state.run_name, state.timestamp)
