"""ThresholdStopper: stop training once a metric crosses a threshold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep.callbacks._watched_metric import Comparison, comparison, evaluated_label, watched_value
from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["ThresholdStopper"]


class ThresholdStopper(Callback):
    """Stop training (``state.stop_training()``) once ``comp(monitor's value, threshold)`` holds.

    ``dataloader_label='eval'`` checks an eval metric at each EVAL_END; ``'train'`` checks the
    training loss (``monitor='loss'``, averaged over the ranks) at each EPOCH_END, and at each
    BATCH_END too with ``stop_on_batch=True``. ``comp``: ``'lt'``/``'less'``, ``'gt'``/``'greater'``
    or a callable; by default ``less`` when the name contains loss, error or perplexity, else
    ``greater``.
    """

    def __init__(self, monitor: str, dataloader_label: str, threshold: float, *,
                 comp: str | Comparison | None = None, stop_on_batch: bool = False) -> None:
        self.monitor = monitor
        self.dataloader_label = dataloader_label
        self.threshold = threshold
        self.stop_on_batch = stop_on_batch
        self.comp_func = comparison(comp, monitor, "ThresholdStopper")

    def _check(self, state: State) -> None:
        value = watched_value(state, self.monitor, self.dataloader_label, "ThresholdStopper")
        if bool(self.comp_func(value, self.threshold)):
            state.stop_training()

    def eval_end(self, state: State, logger: Logger) -> None:
        if self.dataloader_label == evaluated_label(state):
            self._check(state)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.dataloader_label == "train":
            self._check(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.stop_on_batch and self.dataloader_label == "train":
            self._check(state)
