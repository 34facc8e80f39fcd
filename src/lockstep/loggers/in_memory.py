"""Keep every logged value in memory: for tests, notebooks and callbacks that read metrics back."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from lockstep.loggers.logger_destination import LoggerDestination, as_number
from lockstep.time import Timestamp

if TYPE_CHECKING:
    from lockstep.state import State


class InMemoryLogger(LoggerDestination):
    """``data[name]`` is the list of ``(Timestamp, value)`` logged under ``name``;
    ``most_recent_values[name]`` and ``most_recent_timestamps[name]`` the last of them;
    ``hyperparameters`` what :meth:`log_hyperparameters` received.

    Values are stored as given (a loss may be a 0-d tensor); reading ``data`` turns them into numbers.
    As in Composer, every rank keeps what it is given (other destinations log on rank 0 only).
    """

    rank_zero_only = False

    def __init__(self) -> None:
        self._data: dict[str, list[tuple[Timestamp, Any]]] = {}
        self._read: dict[str, int] = {}  # how much of each series is numbers already
        self.hyperparameters: dict[str, Any] = {}
        self.tables: dict[str, str] = {}
        self._state: State | None = None

    @property
    def state(self) -> State | None:
        """The run's State (Composer's attribute): set at INIT; metrics are logged at its timestamp."""
        return self._state

    @state.setter
    def state(self, state: State | None) -> None:
        self._state = state

    def init(self, state: State, logger: Any = None) -> None:
        self._state = state

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        timestamp = self._state.timestamp if self._state is not None else Timestamp(batch=step or 0)
        for name, value in metrics.items():
            self._data.setdefault(name, []).append((timestamp, value))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self.hyperparameters.update(hyperparameters)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table", step: int | None = None) -> None:
        """Keep the table as Composer's InMemoryLogger does: ``tables[name]``, JSON in pandas'
        ``split`` orientation (``{"columns": [...], "data": [[...], ...]}``)."""
        self.tables[name] = json.dumps({"columns": list(columns), "data": [list(r) for r in rows]}, ensure_ascii=False)

    def get_timeseries(self, metric: str) -> dict[str, Any]:
        """Composer's: ``{metric: values, 'epoch': ..., 'batch': ..., ...}``, one numpy array per key,
        each metric value beside the timestamp's counts (and clocks, in seconds) it was logged at."""
        import numpy as np

        if metric not in self.data:
            raise ValueError(f"get_timeseries({metric!r}): no such metric was logged "
                             f"(there: {sorted(self.data)})")
        series: dict[str, list[Any]] = {}
        for timestamp, value in self.data[metric]:
            series.setdefault(metric, []).append(float(value) if isinstance(value, torch.Tensor) else value)
            for field, count in timestamp.state_dict().items():
                series.setdefault(field, []).append(count if isinstance(count, int) else count.total_seconds())
        return {key: np.array(values) for key, values in series.items()}

    @property
    def data(self) -> dict[str, list[tuple[Timestamp, float | int]]]:
        for name, series in self._data.items():
            start = self._read.get(name, 0)
            series[start:] = [(t, as_number(v)) for t, v in series[start:]]
            self._read[name] = len(series)
        return self._data

    @property
    def most_recent_values(self) -> dict[str, float | int]:
        return {name: series[-1][1] for name, series in self.data.items()}

    @property
    def most_recent_timestamps(self) -> dict[str, Timestamp]:
        return {name: series[-1][0] for name, series in self._data.items()}
