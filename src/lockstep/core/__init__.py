"""The training loop's vocabulary, at Composer's ``composer.core`` path: events, callbacks,
algorithms, the state they share, and time."""

from lockstep.core.algorithm import Algorithm
from lockstep.core.callback import Callback
from lockstep.core.event import Event
from lockstep.state import State
from lockstep.time import Time, Timestamp, TimeUnit, ensure_time

__all__ = ["Algorithm", "Callback", "Event", "State", "Time", "TimeUnit", "Timestamp", "ensure_time"]
