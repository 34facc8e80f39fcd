"""cyclic_schedule: Composer's profiling windows of wait, warmup and active batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lockstep.profiler.profiler_action import ProfilerAction

if TYPE_CHECKING:
    from lockstep.state import State

__all__ = ["cyclic_schedule"]


def cyclic_schedule(skip_first: int = 0, wait: int = 0, warmup: int = 1, active: int = 4,
                    repeat: int = 1) -> Callable[[State], ProfilerAction]:
    """A schedule (``State -> ProfilerAction``) of repeated windows, as Composer's.

    In every epoch it skips the first ``skip_first + resumption_batch_idx`` batches
    (``resumption_batch_idx`` is ``state.profiler.resumption_batch_idx``: the batch in the epoch where
    a resumed run started, 0 otherwise; as in Composer it applies to every epoch of that run), then
    runs ``repeat`` cycles (0: cycles until the epoch ends) of ``wait`` skipped batches, ``warmup``
    warm-up batches and ``active`` recorded ones. The last active batch of a cycle, and an active
    batch that is the last of its epoch, is ``ACTIVE_AND_SAVE``.

    The action is for the batch whose index in its epoch is ``state.timestamp.batch_in_epoch``: the
    next batch, when the profiler asks at the end of a batch.
    """
    for name, value, least in (("skip_first", skip_first, 0), ("wait", wait, 0), ("warmup", warmup, 0),
                               ("active", active, 1), ("repeat", repeat, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"cyclic_schedule: {name} must be an int >= {least}, got {value!r}")
    cycle = wait + warmup + active

    def schedule(state: State) -> ProfilerAction:
        batch = _next_batch_in_epoch(state)
        first = skip_first + _resumption_batch_idx(state)
        if batch < first or (repeat != 0 and batch >= first + cycle * repeat):
            return ProfilerAction.SKIP
        position = (batch - first) % cycle
        if position < wait:
            return ProfilerAction.SKIP
        if position < wait + warmup:
            return ProfilerAction.WARMUP
        epoch_length = getattr(state, "batches_per_epoch", None)
        if position == cycle - 1 or (epoch_length is not None and batch == epoch_length - 1):
            return ProfilerAction.ACTIVE_AND_SAVE
        return ProfilerAction.ACTIVE

    return schedule


def _next_batch_in_epoch(state: State) -> int:
    """``batch_in_epoch``; at the end of an epoch's last batch (the timestamp has counted the batch
    but not yet the epoch) the next batch is the next epoch's first: 0."""
    batch = int(state.timestamp.batch_in_epoch)
    epoch_length = getattr(state, "batches_per_epoch", None)
    return 0 if epoch_length and batch >= epoch_length else batch


def _resumption_batch_idx(state: State) -> int:
    profiler = getattr(state, "profiler", None)
    return 0 if profiler is None else int(getattr(profiler, "resumption_batch_idx", 0))
