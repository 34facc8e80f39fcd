"""Composer's ``create_interval_scheduler``: an interval as a function of (state, event), such as
``CheckpointSaver(save_interval=...)`` accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lockstep.core.event import Event
from lockstep.time import Time, TimeUnit

if TYPE_CHECKING:
    from lockstep.core.state import State

__all__ = ["create_interval_scheduler"]

_BY_BATCH = (TimeUnit.BATCH, TimeUnit.TOKEN, TimeUnit.SAMPLE, TimeUnit.DURATION, TimeUnit.SECOND)


def create_interval_scheduler(interval: str | int | Time, include_end_of_training: bool = True,
                              checkpoint_events: bool = True,
                              final_events: set[Event] | None = None) -> Callable[[State, Event], bool]:
    """A function that is True at the event after each ``interval`` of training (an int counts
    epochs): at EPOCH_CHECKPOINT for ``ep``, ITERATION_CHECKPOINT for ``iter``, BATCH_CHECKPOINT
    for the other units (their ``_END`` events with ``checkpoint_events=False``); and, with
    ``include_end_of_training``, once at the end of training (at one of ``final_events``)."""
    if final_events is None:
        final_events = {Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT}
    time_interval = Time.from_input(interval, TimeUnit.EPOCH)
    if time_interval.unit is TimeUnit.EPOCH:
        due_event = Event.EPOCH_CHECKPOINT if checkpoint_events else Event.EPOCH_END
    elif time_interval.unit is TimeUnit.ITERATION:
        due_event = Event.ITERATION_CHECKPOINT if checkpoint_events else Event.ITERATION_END
    elif time_interval.unit in _BY_BATCH:
        due_event = Event.BATCH_CHECKPOINT if checkpoint_events else Event.BATCH_END
    else:  # pragma: no cover - TimeUnit has no other member
        raise NotImplementedError(f"an interval in {time_interval.unit} is not supported")
    last_batch_seen = -1

    def is_due(state: State, event: Event) -> bool:
        nonlocal last_batch_seen
        if time_interval.unit is not TimeUnit.DURATION and time_interval.value <= 0:
            return False
        if state.previous_timestamp is None:
            return False
        elapsed = state.get_elapsed_duration()
        assert elapsed is not None, "an interval needs state.max_duration"
        if include_end_of_training and event in final_events and elapsed.value >= 1.0 \
                and state.timestamp.batch != last_batch_seen:
            return True
        if time_interval.unit is TimeUnit.DURATION:
            assert state.max_duration is not None
            unit, step = state.max_duration.unit, time_interval.value * state.max_duration.value
        else:
            unit, step = time_interval.unit, time_interval.value
        before = state.previous_timestamp.get(unit).value
        now = state.timestamp.get(unit).value
        if event is due_event and before // step < now // step:
            last_batch_seen = int(state.timestamp.batch)
            return True
        return False

    return is_due
