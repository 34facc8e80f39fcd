"""The events of the training loop, at which callbacks and algorithms run.

Where each :class:`Event` fires (Composer's events and order), as pseudocode of ``Trainer``::

    INIT                                  # Trainer.__init__, once callbacks are in place
    BEFORE_LOAD, AFTER_LOAD               # around loading load_path / autoresume
    FIT_START
    while not reached(max_duration):
        ITERATION_START                   # before the first epoch of training (timestamp at zero)
        EPOCH_START                       # not when resuming mid-epoch
        while True:
            BEFORE_DATALOADER
            batch = next(train_dataloader)  # every rank stops together if one runs out
            AFTER_DATALOADER
            BATCH_START
            BEFORE_TRAIN_BATCH
            for microbatch in split(batch):
                BEFORE_FORWARD; outputs = model(microbatch); AFTER_FORWARD
                BEFORE_LOSS; loss = model.loss(outputs, microbatch); AFTER_LOSS
                BEFORE_BACKWARD; (loss * share of global batch).backward(); AFTER_BACKWARD
            AFTER_TRAIN_BATCH             # gradients synchronized, not yet applied (clipping)
            optimizer.step(); zero_grad()
            timestamp.to_next_batch(); per-batch schedulers.step()
            BATCH_END                     # state.timestamp and state.loss are updated
            if eval due (ba sp tok):      # EVAL_BEFORE_ALL, EVAL_START,
                evaluate                  #   per batch EVAL_BATCH_START, EVAL_BEFORE_FORWARD,
                                          #   EVAL_AFTER_FORWARD, EVAL_BATCH_END; EVAL_END, EVAL_AFTER_ALL
            if save due (ba sp tok) and not the epoch's last batch: checkpoint
            BATCH_CHECKPOINT
            if the epoch's last batch:
                timestamp.to_next_epoch(); per-epoch schedulers.step()
                EPOCH_END                 # state.timestamp counts the finished epoch from here on
                if eval due (ep): evaluate
                if save due (any unit): checkpoint   # so {epoch} in its name counts this epoch
                EPOCH_CHECKPOINT
            if every rank saw SIGTERM: checkpoint, FIT_END, exit 143
            if reached(max_duration): break
    if not saved at this batch: checkpoint   # with save_folder
    FIT_END

ITERATION_END and ITERATION_CHECKPOINT exist for ported callbacks; as in Composer, they fire only
for runs split into iterations of several epochs, which lockstep does not have, so they never fire.
``Trainer.eval()`` called by the user runs EVAL_STANDALONE_START, the evaluation (EVAL_START ...
EVAL_END), then EVAL_STANDALONE_END. ``Trainer.predict(dataloader)`` runs PREDICT_START, per batch
PREDICT_BATCH_START, PREDICT_BEFORE_FORWARD, ``outputs = model(batch)``, PREDICT_AFTER_FORWARD,
PREDICT_BATCH_END, then PREDICT_END. During the microbatch loop ``state.batch`` is the microbatch,
``state.outputs`` its outputs and ``state.loss`` its loss (a callback or algorithm may replace
either); after the batch ``state.loss`` is the batch's mean loss.

The Trainer itself logs ``loss/train/total``, ``time/batch`` and ``time/epoch`` after every batch,
``metrics/eval/<Name>`` after each evaluation, and its configuration at FIT_START.

Algorithms (``Trainer(algorithms=[...])``) run at the same events, before the callbacks.
When ``fit`` raises, each callback's :meth:`Callback.close` runs before the error propagates
(loggers write what they buffered).

A callback (:class:`~lockstep.core.callback.Callback`) overrides the methods named after the events it
cares about.
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    INIT = "init"
    BEFORE_LOAD = "before_load"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    ITERATION_START = "iteration_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BATCH_END = "batch_end"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    ITERATION_END = "iteration_end"
    ITERATION_CHECKPOINT = "iteration_checkpoint"
    FIT_END = "fit_end"
    EVAL_BEFORE_ALL = "eval_before_all"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    EVAL_AFTER_ALL = "eval_after_all"
    EVAL_STANDALONE_START = "eval_standalone_start"
    EVAL_STANDALONE_END = "eval_standalone_end"
    PREDICT_START = "predict_start"
    PREDICT_BATCH_START = "predict_batch_start"
    PREDICT_BEFORE_FORWARD = "predict_before_forward"
    PREDICT_AFTER_FORWARD = "predict_after_forward"
    PREDICT_BATCH_END = "predict_batch_end"
    PREDICT_END = "predict_end"

    @property
    def is_before_event(self) -> bool:
        """Whether this event opens a pair (``BEFORE_LOSS`` ... ``AFTER_LOSS``, ``EPOCH_START`` ... ``EPOCH_END``)."""
        return self in _BEFORE

    @property
    def is_after_event(self) -> bool:
        """Whether this event closes a pair; algorithms run in reverse order at these (Composer's FILO rule)."""
        return self in _AFTER

    @property
    def canonical_name(self) -> str:
        """The name shared by the two events of a pair: ``'epoch'`` for EPOCH_START and EPOCH_END."""
        name = self.value
        for marker in ("before_", "after_", "_start", "_end"):
            name = name.replace(marker, "")
        return name

    @property
    def is_eval(self) -> bool:
        """Whether this is an event of the evaluation loop."""
        return self.value.startswith("eval")

    @property
    def is_predict(self) -> bool:
        """Whether this is an event of the prediction loop."""
        return self.value.startswith("predict")


_BEFORE = frozenset((
    Event.BEFORE_LOAD, Event.FIT_START, Event.ITERATION_START, Event.EPOCH_START, Event.BEFORE_DATALOADER,
    Event.BATCH_START, Event.BEFORE_TRAIN_BATCH, Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.BEFORE_BACKWARD,
    Event.EVAL_BEFORE_ALL, Event.EVAL_START, Event.EVAL_BATCH_START, Event.EVAL_BEFORE_FORWARD,
    Event.PREDICT_START, Event.PREDICT_BATCH_START, Event.PREDICT_BEFORE_FORWARD, Event.EVAL_STANDALONE_START))
_AFTER = frozenset((
    Event.AFTER_LOAD, Event.ITERATION_END, Event.EPOCH_END, Event.BATCH_END, Event.AFTER_DATALOADER,
    Event.AFTER_TRAIN_BATCH, Event.AFTER_FORWARD, Event.AFTER_LOSS, Event.AFTER_BACKWARD, Event.EVAL_AFTER_ALL,
    Event.EVAL_END, Event.EVAL_BATCH_END, Event.EVAL_AFTER_FORWARD, Event.FIT_END, Event.PREDICT_END,
    Event.PREDICT_BATCH_END, Event.PREDICT_AFTER_FORWARD, Event.EVAL_STANDALONE_END))
