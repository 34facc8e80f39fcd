"""Callbacks: code that runs at named points of the training loop.

Where each :class:`Event` fires, as pseudocode of ``Trainer.fit``::

    INIT                                  # end of Trainer.__init__
    FIT_START
    while not reached(max_duration):
        EPOCH_START
        for batch in train_dataloader:    # every rank stops together if one runs out
            BATCH_START
            for microbatch in split(batch):
                forward, loss * share of global batch, backward   (DDP sync per strategy)
            AFTER_TRAIN_BATCH             # gradients synchronized, not yet applied (clipping)
            optimizer.step(); scheduler.step(); zero_grad()
            BATCH_END                     # state.timestamp and state.loss are updated
            EPOCH_END                     # after the epoch's last batch
            if eval due: EVAL_START ... EVAL_END
            if save due: checkpoint       # with save_folder; also once more at the end
            if every rank saw SIGTERM: checkpoint, FIT_END, exit 143
            if reached(max_duration): break
    FIT_END

The Trainer itself logs ``loss/train/total``, ``time/batch`` and ``time/epoch`` after every batch,
``metrics/eval/<Name>`` after each evaluation, and its configuration at FIT_START.

Algorithms (``Trainer(algorithms=[...])``) run at the same events, before the callbacks.
When ``fit`` raises, each callback's :meth:`Callback.close` runs before the error propagates
(loggers write what they buffered).

A callback overrides the methods named after the events it cares about, with Composer's signature
``event(self, state, logger)``: ``state`` is the Trainer's :class:`~lockstep.state.State`, ``logger``
a :class:`~lockstep.loggers.Logger` whose ``log_metrics({name: value})`` and
``log_hyperparameters({...})`` reach every destination in ``Trainer(loggers=[...])``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockstep.loggers import Logger
    from lockstep.state import State


class Event(StrEnum):
    INIT = "init"
    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    BATCH_START = "batch_start"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BATCH_END = "batch_end"
    EPOCH_END = "epoch_end"
    EVAL_START = "eval_start"
    EVAL_END = "eval_end"
    FIT_END = "fit_end"


class Callback:
    """Base class: every event method does nothing unless overridden."""

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        getattr(self, event.value)(state, logger)

    def init(self, state: State, logger: Logger) -> None: ...
    def fit_start(self, state: State, logger: Logger) -> None: ...
    def epoch_start(self, state: State, logger: Logger) -> None: ...
    def batch_start(self, state: State, logger: Logger) -> None: ...
    def after_train_batch(self, state: State, logger: Logger) -> None: ...
    def batch_end(self, state: State, logger: Logger) -> None: ...
    def epoch_end(self, state: State, logger: Logger) -> None: ...
    def eval_start(self, state: State, logger: Logger) -> None: ...
    def eval_end(self, state: State, logger: Logger) -> None: ...
    def fit_end(self, state: State, logger: Logger) -> None: ...

    def close(self, state: State, logger: Logger) -> None:
        """Called by ``Trainer.close()``, and when ``fit`` raises: write out anything held in memory
        and release what was opened."""


from lockstep.callbacks.monitors import LRMonitor, MemoryMonitor, RuntimeEstimator, SpeedMonitor  # noqa: E402

__all__ = ["Callback", "Event", "LRMonitor", "MemoryMonitor", "RuntimeEstimator", "SpeedMonitor"]
