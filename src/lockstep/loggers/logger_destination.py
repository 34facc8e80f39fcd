"""LoggerDestination: a place metrics are written to (TensorBoard, MLflow, ...), and the small
helpers destinations share."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

import torch

from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.state import State


class LoggerDestination(Callback):
    """A place metrics are written to. Subclasses override :meth:`log_metrics` and
    :meth:`log_hyperparameters`; as callbacks they also see every event (to open and flush).

    With ``rank_zero_only`` (the default) only global rank 0 receives calls.
    """

    rank_zero_only: bool = True

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record ``metrics`` (values may be floats, ints or 0-d tensors) at ``step`` (a batch count)."""

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Record the run's configuration."""

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str = "Table", step: int | None = None) -> None:
        """Record a table (``rows`` under ``columns``); destinations without tables ignore it."""

    def log_traces(self, traces: dict[str, Any]) -> None:
        """Record which algorithms ran at an event (``algorithm_traces/<Algorithm>/<Event>``: 1 or 0)."""

    def upload_file(self, state: State, remote_file_name: str, file_path: pathlib.Path, *, overwrite: bool) -> None:
        """Copy the local file ``file_path`` to ``remote_file_name`` (destinations that store files)."""

    def flush(self) -> None:
        """Write out everything received so far."""


def as_number(value: Any) -> float | int:
    """A metric value as a Python number (a tensor is read here: call it off the training thread)."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return float(value)


def require(module: str, extra: str, user: str) -> Any:
    """Import the optional ``module`` that ``user`` needs, or raise a one-line error naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{user} needs the '{module.split('.')[0]}' package: pip install "
                          f"'torch-lockstep[{extra}]'") from None
