"""EarlyStopper: stop training when a metric has not improved for a while."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lockstep.callbacks._watched_metric import Comparison, comparison, evaluated_label, watched_value
from lockstep.core.callback import Callback
from lockstep.time import Time, Timestamp, TimeUnit

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["EarlyStopper"]


class EarlyStopper(Callback):
    """Stop training (``state.stop_training()``) once ``monitor`` has gone ``patience`` without
    improving by more than ``min_delta``.

    ``dataloader_label='eval'`` watches an eval metric (``'loss'`` or a name of the model's eval
    metrics), checked at each EVAL_END; ``'train'`` watches the training loss (``monitor='loss'``,
    averaged over the ranks), checked at each EPOCH_END, and at each BATCH_END when ``patience`` is
    in batches. ``comp(current, best)`` says what improving is: ``'lt'``/``'less'``,
    ``'gt'``/``'greater'`` or a callable; by default lower is better when the name contains loss,
    error or perplexity, higher otherwise. ``patience``: a Time in ``ep`` or ``ba`` (an int counts
    epochs); training stops when more than that has passed since the best value.
    """

    def __init__(self, monitor: str, dataloader_label: str, comp: str | Comparison | None = None,
                 min_delta: float = 0.0, patience: int | str | Time = 1) -> None:
        self.monitor = monitor
        self.dataloader_label = dataloader_label
        self.comp_func = comparison(comp, monitor, "EarlyStopper")
        self.min_delta = abs(min_delta)
        self.patience = Time.from_input(patience, TimeUnit.EPOCH)
        if self.patience.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH):
            raise ValueError(f"EarlyStopper(patience={patience!r}): give patience in epochs or batches, "
                             f"e.g. '2ep' or '100ba'")
        self.best: torch.Tensor | None = None
        self.best_occurred: Timestamp | None = None

    def _update(self, state: State) -> None:
        value = watched_value(state, self.monitor, self.dataloader_label, "EarlyStopper")
        if self.best is None or (bool(self.comp_func(value, self.best))
                                 and float(torch.abs(value - self.best)) > self.min_delta):
            self.best, self.best_occurred = value, state.timestamp
        since = _count(state.timestamp, self.patience.unit) - _count(self.best_occurred, self.patience.unit)
        if since > self.patience.value:
            state.stop_training()

    def eval_end(self, state: State, logger: Logger) -> None:
        if self.dataloader_label == evaluated_label(state):
            self._update(state)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.dataloader_label == "train":
            self._update(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.patience.unit is TimeUnit.BATCH and self.dataloader_label == "train":
            self._update(state)


def _count(timestamp: Any, unit: TimeUnit) -> int:
    return int(timestamp.epoch if unit is TimeUnit.EPOCH else timestamp.batch)
