"""What a callback is handed as ``logger``, as a type: :class:`lockstep.loggers.Logger` is the one
implementation. The loop's vocabulary names this protocol rather than the class, which lives with
the logger destinations a layer above, so that no module below them imports them, even for types."""

from __future__ import annotations

import pathlib
from typing import Any, Protocol


class Logger(Protocol):
    """Passes each call to every destination that logs on this rank."""

    destinations: list[Any]

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None: ...

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table",
                  step: int | None = None) -> None: ...

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None: ...

    def log_traces(self, traces: dict[str, Any]) -> None: ...

    def has_file_upload_destination(self) -> bool: ...

    def upload_file(self, remote_file_name: str, file_path: str | pathlib.Path, *, overwrite: bool = False) -> None: ...
