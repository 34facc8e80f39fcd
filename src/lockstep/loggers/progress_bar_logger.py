"""ProgressBarLogger: Composer's name for the progress bar, as a logger destination."""

from __future__ import annotations

from typing import IO, Any

from lockstep.callbacks.run_files import ProgressBar
from lockstep.loggers.logger import format_log_data_value
from lockstep.loggers.logger_destination import LoggerDestination

__all__ = ["ProgressBarLogger"]


class ProgressBarLogger(ProgressBar, LoggerDestination):
    """lockstep's progress bar (:class:`~lockstep.callbacks.run_files.ProgressBar`: one bar over the
    whole run, with the loss, samples/s and ETA, on rank 0) on ``stream``. Passed in
    ``Trainer(loggers=[...])``, it takes the place of the bar that ``progress_bar=True`` draws.
    ``log_traces``: also print what ``logger.log_traces`` receives, above the bar."""

    def __init__(self, stream: str | IO[str] = "stderr", log_traces: bool = False) -> None:
        super().__init__(stream)
        self.should_log_traces = log_traces

    def log_traces(self, traces: dict[str, Any]) -> None:
        if self.should_log_traces:
            for name, trace in traces.items():
                line = f"[trace]: {name}:{format_log_data_value(trace)}"
                if self._bar is not None:
                    self._bar.write(line, file=self.stream)
                else:
                    print(line, file=self.stream, flush=True)
