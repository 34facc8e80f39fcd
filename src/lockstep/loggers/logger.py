"""Logger: what callbacks call ``logger.log_metrics(...)`` on; it hands each call to every
:class:`~lockstep.loggers.logger_destination.LoggerDestination` that logs on this rank."""

from __future__ import annotations

import collections.abc
import functools
import pathlib
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lockstep import dist

if TYPE_CHECKING:
    from lockstep.loggers.logger_destination import LoggerDestination
    from lockstep.state import State


class Logger:
    """What callbacks call ``logger.log_metrics(...)`` on: passes each call to every destination
    that logs on this rank. A destination that raises is reported once, and training goes on."""

    def __init__(self, state: State, destinations: LoggerDestination | Sequence[LoggerDestination] | None = None) -> None:
        from lockstep.batch import ensure_tuple

        self._state = state
        self.destinations = list(ensure_tuple(destinations))
        self._failed: set[int] = set()
        self._rank: int | None = None  # read at the first call: a rank does not change during a run

    @property
    def active(self) -> list[LoggerDestination]:
        if self._rank is None:
            self._rank = dist.get_global_rank()
        rank = self._rank
        return [d for d in self.destinations if rank == 0 or not d.rank_zero_only]

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        step = self._state.timestamp.batch.value if step is None else step
        for destination in self.active:
            self._call(destination, destination.log_metrics, metrics, step)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table", step: int | None = None) -> None:
        """A table (``rows`` of values under ``columns``), e.g. the ``Generate`` callback's samples."""
        step = self._state.timestamp.batch.value if step is None else step
        for destination in self.active:
            self._call(destination, destination.log_table, columns, rows, name, step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        for destination in self.active:
            self._call(destination, destination.log_hyperparameters, hyperparameters)

    def log_traces(self, traces: dict[str, Any]) -> None:
        for destination in self.active:
            self._call(destination, destination.log_traces, traces)

    def has_file_upload_destination(self) -> bool:
        """Whether a destination stores files (a RemoteUploaderDownloader): :meth:`upload_file` does something."""
        return any(getattr(d, "can_upload_files", lambda: False)() for d in self.destinations)

    def upload_file(self, remote_file_name: str, file_path: str | pathlib.Path, *, overwrite: bool = False) -> None:
        """Hand a local file to every destination that stores files (with none, nothing happens). Both
        names may hold ``{run_name}``, ``{rank}``, ... ."""
        from lockstep.checkpoint.templates import format_name, place_values

        place = place_values(self._state.run_name)
        path, remote = pathlib.Path(format_name(str(file_path), place)), format_name(remote_file_name, place)
        for destination in self.active:
            upload = functools.partial(destination.upload_file, overwrite=overwrite)
            self._call(destination, upload, self._state, remote, path)

    def _call(self, destination: LoggerDestination, method: Any, *args: Any) -> None:
        try:
            method(*args)
        except Exception as e:  # noqa: BLE001 - a logger must not stop training
            report_failure(destination, e, self._failed)


def report_failure(destination: Any, error: BaseException, failed: set[int]) -> None:
    """Warn about a failing destination the first time it fails."""
    if id(destination) not in failed:
        failed.add(id(destination))
        warnings.warn(f"{type(destination).__name__} failed and is skipped from now on where it fails: "
                      f"{type(error).__name__}: {error}; training goes on", RuntimeWarning, stacklevel=3)


def format_log_data_value(data: Any) -> str:
    """A logged value as Composer's text loggers write it: floats to 4 decimals, strings quoted, a
    one-element tensor as its number, mappings and sequences item by item."""
    import torch

    if data is None:
        return "None"
    if isinstance(data, str):
        return f'"{data}"'
    if isinstance(data, int):
        return str(data)
    if isinstance(data, float):
        return f"{data:.4f}"
    if isinstance(data, torch.Tensor):
        return format_log_data_value(data.item()) if data.numel() == 1 else f"Tensor of shape {data.shape}"
    if isinstance(data, collections.abc.Mapping):
        return "{ " + "".join(f'"{k}": {format_log_data_value(v)}, ' for k, v in data.items()) + "}"
    if isinstance(data, collections.abc.Iterable):
        return "[" + ", ".join(format_log_data_value(v) for v in data) + "]"
    return str(data)
