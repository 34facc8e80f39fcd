"""When a checkpoint is due: ``save_interval`` as a Time (batches, samples, tokens, epochs, or a
fraction of ``max_duration``) or a function of the state and the event."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lockstep.time import Time, Timestamp, TimeUnit, is_interval_due

if TYPE_CHECKING:
    from lockstep.core.state import State


class SaveSchedule:
    """``interval`` (parsed by :class:`~lockstep.checkpoint.config.CheckpointConfig`) against the
    run's ``max_duration`` (which a ``fit(duration=...)`` may move)."""

    def __init__(self, interval: Any, max_duration: Time | None) -> None:
        self.interval, self.max_duration = interval, max_duration

    def due(self, before: Timestamp, after: Timestamp, event: object, state: State, *, epoch_end: bool) -> bool:
        """Whether a checkpoint is due between ``before`` and ``after``, at the end of a batch or
        (``epoch_end``) of an epoch. A ``save_interval`` function decides itself, from ``state`` and
        ``event`` (the Trainer's Event of that moment)."""
        interval = self.interval
        if callable(interval):
            return bool(interval(state, event))
        assert isinstance(interval, Time)  # CheckpointConfig parsed it
        unit = interval.unit
        if unit is TimeUnit.DURATION:
            assert self.max_duration is not None  # the writer refuses a 'dur' interval without it
            unit = self.max_duration.unit
        if (unit is TimeUnit.EPOCH) != epoch_end:
            return False
        return is_interval_due(before, after, interval, self.max_duration)

