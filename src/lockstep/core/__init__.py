"""The training loop's vocabulary, at Composer's ``composer.core`` path: events, callbacks,
algorithms, the state they share, time, evaluators and data specs."""

from lockstep.core.algorithm import Algorithm
from lockstep.core.callback import Callback
from lockstep.core.data_spec import DataSpec, ensure_data_spec
from lockstep.core.evaluator import Evaluator, ensure_evaluator
from lockstep.core.event import Event
from lockstep.state import State
from lockstep.time import Time, Timestamp, TimeUnit, ensure_time

__all__ = ["Algorithm", "Callback", "DataSpec", "Evaluator", "Event", "State", "Time", "TimeUnit", "Timestamp",
           "ensure_data_spec", "ensure_evaluator", "ensure_time"]
