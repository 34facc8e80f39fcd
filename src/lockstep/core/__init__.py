"""The training loop's vocabulary, at Composer's ``composer.core`` path: events, callbacks,
algorithms, the state they share, time, evaluators, data specs, precisions and type names."""

from lockstep.core.algorithm import Algorithm
from lockstep.core.callback import Callback
from lockstep.core.data_spec import DataSpec, ensure_data_spec
from lockstep.core.engine import Engine, Trace, Traces
from lockstep.core.evaluator import Evaluator, ensure_evaluator
from lockstep.core.event import Event
from lockstep.core.precision import Precision, get_precision_context
from lockstep.core.types import JSON, Batch, Dataset, TrainerMode
from lockstep.core.state import State
from lockstep.time import Time, Timestamp, TimeUnit, ensure_time

__all__ = ["JSON", "Algorithm", "Batch", "Callback", "DataSpec", "Dataset", "Engine", "Evaluator", "Event",
           "Precision", "State", "Time", "TimeUnit", "Timestamp", "Trace", "Traces", "TrainerMode", "ensure_data_spec",
           "ensure_evaluator", "ensure_time", "get_precision_context"]
