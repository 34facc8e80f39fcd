"""Print metrics on the console every ``log_interval``, as Composer's ``log_to_console=True`` does."""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING, Any

from lockstep.loggers.logger import format_log_data_value
from lockstep.loggers.logger_destination import LoggerDestination, as_number
from lockstep.time import Time, TimeUnit, Timestamp, is_interval_due, time_argument

if TYPE_CHECKING:
    from lockstep.state import State

_EVAL_PREFIX = "metrics/eval/"


class ConsoleLogger(LoggerDestination):
    """One line of the latest training metrics every ``log_interval`` (a Time; an int counts
    epochs), and the evaluation metrics after each evaluation, on rank 0.

    Values are read (a device sync for a loss tensor) only when a line is printed. ``stream``:
    ``'stderr'``, ``'stdout'`` or a text stream. ``log_traces``: also print what
    ``logger.log_traces`` receives, as ``[trace]: <name>:<value>``.
    """

    def __init__(self, log_interval: int | str | Time = "1ba", stream: str | IO[str] = "stderr",
                 log_traces: bool = False) -> None:
        self.log_interval = time_argument("log_interval", log_interval)
        if isinstance(stream, str) and stream.lower() not in ("stdout", "stderr"):
            raise ValueError(f"ConsoleLogger(stream={stream!r}): use 'stdout', 'stderr' or a text stream")
        self._stream = stream.lower() if isinstance(stream, str) else stream
        self.should_log_traces = log_traces
        self._train: dict[str, Any] = {}
        self._eval: dict[str, Any] = {}
        self._before = Timestamp()

    @property
    def stream(self) -> IO[str]:
        if isinstance(self._stream, str):
            return sys.stdout if self._stream == "stdout" else sys.stderr
        return self._stream

    def log_traces(self, traces: dict[str, Any]) -> None:
        if self.should_log_traces:
            for name, trace in traces.items():
                print(f"[trace]: {name}:{format_log_data_value(trace)}", file=self.stream, flush=True)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for name, value in metrics.items():
            (self._eval if name.startswith(_EVAL_PREFIX) else self._train)[name] = value

    def fit_start(self, state: State, logger: Any) -> None:
        self._before = state.timestamp

    def batch_end(self, state: State, logger: Any) -> None:
        if self.log_interval.unit is not TimeUnit.EPOCH:
            self._print_if_due(state)

    def epoch_end(self, state: State, logger: Any) -> None:
        if self.log_interval.unit is TimeUnit.EPOCH:
            self._print_if_due(state)

    def eval_end(self, state: State, logger: Any) -> None:
        if self._eval:
            self._write(state, "eval", self._eval)
            self._eval = {}

    def _print_if_due(self, state: State) -> None:
        before, self._before = self._before, state.timestamp
        if self._train and is_interval_due(before, state.timestamp, self.log_interval, state.max_duration):
            self._write(state, "train", self._train)

    def _write(self, state: State, kind: str, metrics: dict[str, Any]) -> None:
        t, total = state.timestamp, state.max_duration
        of = f"/{total.value}" if total is not None and total.unit is TimeUnit.BATCH else ""
        values = ", ".join(f"{name}: {_format(as_number(v))}" for name, v in metrics.items())
        print(f"[epoch={t.epoch.value}][batch={t.batch.value}{of}] {kind} {values}", file=self.stream, flush=True)


def _format(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4f}"
