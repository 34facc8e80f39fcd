"""FileLogger: every rank writes what is logged (and what it prints) to its own text file."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from typing import IO, TYPE_CHECKING, Any

from lockstep.checkpoint.templates import format_name, place_values
from lockstep.loggers.logger import format_log_data_value
from lockstep.loggers.logger_destination import LoggerDestination

if TYPE_CHECKING:
    from lockstep.loggers.logger import Logger
    from lockstep.state import State

__all__ = ["FileLogger"]

_TEXT = object()  # a pending entry that is text already, not a value to format
_DRAIN_SECONDS = 1.0


class FileLogger(LoggerDestination):
    """Writes, on every rank, to ``filename`` (``{run_name}``, ``{rank}``, ``{local_rank}``,
    ``{world_size}``, ``{local_world_size}``, ``{node_rank}``; relative to the working directory),
    one line per entry, in Composer's format::

        [metric][batch=12]: loss/train/total: 0.6931
        [hyperparameter]: max_duration: "10ba"
        [trace]: algorithm_traces/<Algorithm>/<event>:1
        [stdout]: what the script printed

    ``capture_stdout`` / ``capture_stderr``: also copy what this process prints (from construction
    until :meth:`close`). ``buffer_size``: the file's buffering (1: by line). ``log_traces``: write
    what ``logger.log_traces`` receives (lockstep's Trainer does not send algorithm traces yet).
    ``flush_interval``: batches (and epochs) between flushes to disk, which
    also hand the file to the loggers' file uploaders as ``remote_file_name`` (default: ``filename``).
    ``overwrite``: start the file afresh; otherwise an existing file is appended to.

    Metric values (a loss tensor, say) are read when written: within a second, at each flush, and
    before any other line, so that writing them costs a batch no device sync.
    """

    rank_zero_only = False

    def __init__(self, filename: str = "{run_name}/logs-rank{rank}.txt", remote_file_name: str | None = None, *,
                 capture_stdout: bool = True, capture_stderr: bool = True, buffer_size: int = 1,
                 log_traces: bool = True, flush_interval: int = 100, overwrite: bool = False) -> None:
        self.filename_format = filename
        self.remote_file_name_format = filename.replace(os.sep, "/") if remote_file_name is None else remote_file_name
        self.buffer_size, self.should_log_traces = buffer_size, log_traces
        self.flush_interval, self.overwrite = flush_interval, overwrite
        self.file: IO[str] | None = None
        self._run_name: str | None = None
        self._pending: list[tuple[str, str, Any, str, bool]] = []  # (line prefix, head, value, tail, own line)
        self._lock = threading.RLock()  # the captured streams may be written from any thread
        self._is_newline, self._closed, self._drained_at = True, False, time.monotonic()
        self._captured: list[tuple[Any, Any, Any, bool]] = []  # (stream, its write, ours, whether it had its own)
        if capture_stdout:
            self._capture(sys.stdout, "[stdout]: ")
        if capture_stderr:
            self._capture(sys.stderr, "[stderr]: ")

    @property
    def filename(self) -> str:
        """This rank's file (known from INIT on)."""
        return format_name(self.filename_format, place_values(self._known_run_name()))

    @property
    def remote_file_name(self) -> str:
        return format_name(self.remote_file_name_format, place_values(self._known_run_name())).lstrip("/")

    def _known_run_name(self) -> str:
        if self._run_name is None:
            raise RuntimeError("FileLogger knows its file from INIT on: pass it to Trainer(loggers=[...]) first")
        return self._run_name

    def init(self, state: State, logger: Logger) -> None:
        if self.file is not None:
            raise RuntimeError("FileLogger is already in use by a Trainer: give each Trainer its own")
        self._run_name, self._is_newline = state.run_name, True
        path = self.filename
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.file = open(path, "w" if self.overwrite else "a", buffering=self.buffer_size)
        self._drain()

    # -- what is logged -------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        with self._lock:
            self._pending += [(f"[metric][batch={step}]: ", f"{name}: ", value, " \n", True)
                              for name, value in metrics.items()]

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        for name, value in hyperparameters.items():
            self._add_text("[hyperparameter]: ", f"{name}: {format_log_data_value(value)} \n", own_line=True)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table",
                  step: int | None = None) -> None:
        """One line: the table as JSON (``{"columns": [...], "data": [[...], ...]}``), as Composer writes it."""
        table = json.dumps({"columns": list(columns), "data": [list(r) for r in rows]}, separators=(",", ":"),
                           ensure_ascii=False)
        self._add_text("[table]: ", f"{name}: {table}\n", own_line=True)

    def log_traces(self, traces: dict[str, Any]) -> None:
        if self.should_log_traces:
            for name, trace in traces.items():
                self._add_text(f"[trace]: {name}:", format_log_data_value(trace) + "\n", own_line=True)

    def write(self, prefix: str, s: str) -> None:
        """Write ``s`` with ``prefix`` at the start of each of its lines (kept until INIT opens the file)."""
        self._add_text(prefix, s, own_line=False)

    def _add_text(self, prefix: str, s: str, own_line: bool) -> None:
        """``own_line``: start on a line of its own, even after a partial line (a progress bar's)."""
        with self._lock:
            self._pending.append((prefix, s, _TEXT, "", own_line))
            if self.file is not None:
                self._drain()

    # -- when it reaches the file ---------------------------------------------------------------

    def _drain(self) -> None:
        """Format what is pending, in order, into the file."""
        with self._lock:
            if self.file is None:
                return
            pending, self._pending = self._pending, []
            self.file.write("".join(self._prefixed(prefix, head if value is _TEXT else
                                                   f"{head}{format_log_data_value(value)}{tail}", own_line)
                                    for prefix, head, value, tail, own_line in pending))
            self._drained_at = time.monotonic()

    def _prefixed(self, prefix: str, s: str, own_line: bool) -> str:
        """``s`` with ``prefix`` before each line that starts here (not before empty lines)."""
        out = []
        if own_line and not self._is_newline:
            out.append(os.linesep)
            self._is_newline = True
        for line in s.splitlines(True):
            out.append(f"{prefix}{line}" if self._is_newline and line != os.linesep else line)
            self._is_newline = line.endswith(os.linesep)
        return "".join(out)

    def _flush_file(self, logger: Logger) -> None:
        """Everything to disk (fsync), then to the file uploaders."""
        if self.file is None:
            return
        self._drain()
        self.file.flush()
        os.fsync(self.file.fileno())
        logger.upload_file(self.remote_file_name, self.file.name, overwrite=True)

    def batch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) % self.flush_interval == 0:
            self._flush_file(logger)
        elif time.monotonic() - self._drained_at >= _DRAIN_SECONDS:
            self._drain()

    def epoch_start(self, state: State, logger: Logger) -> None:
        self._flush_file(logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.epoch) % self.flush_interval == 0:
            self._flush_file(logger)

    def eval_start(self, state: State, logger: Logger) -> None:
        self._flush_file(logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._flush_file(logger)

    def close(self, state: State, logger: Logger) -> None:
        self._closed = True
        self._release_streams()
        if self.file is not None:
            self._flush_file(logger)
            self.file.close()
            self.file = None

    # -- stdout and stderr ----------------------------------------------------------------------

    def _capture(self, stream: Any, prefix: str) -> None:
        own, had_own = stream.write, "write" in getattr(stream, "__dict__", {})

        def write(s: str) -> int:
            if not self._closed:
                self.write(prefix, s)
            return own(s)

        try:
            stream.write = write
        except (AttributeError, TypeError):
            warnings.warn(f"FileLogger cannot copy {prefix[1:-3]} ({type(stream).__name__} takes no new write); "
                          f"pass capture_{prefix[1:-3]}=False", stacklevel=3)
            return
        self._captured.append((stream, own, write, had_own))

    def _release_streams(self) -> None:
        """Give the streams their own write back (unless something replaced ours since)."""
        for stream, own, ours, had_own in self._captured:
            if getattr(stream, "__dict__", {}).get("write") is ours:
                if had_own:
                    stream.write = own
                else:
                    del stream.write
        self._captured = []
