"""Running the loop's events: the algorithms and the callbacks that act at each one, kept indexed
so that an event nothing acts at costs a dict lookup (and the step's own events, nothing)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lockstep.core.algorithm import Algorithm
from lockstep.core.callback import Callback
from lockstep.core.event import Event
from lockstep.callbacks.run_files import Buffered
from lockstep.loggers.logger import Logger
from lockstep.state import State

STEP_EVENTS = (Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START, Event.BEFORE_TRAIN_BATCH,
               Event.BEFORE_FORWARD, Event.AFTER_FORWARD, Event.BEFORE_LOSS, Event.AFTER_LOSS,
               Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD, Event.AFTER_TRAIN_BATCH)
"""The events of a step before BATCH_END: dispatched only when something acts at one of them."""


AlgorithmPass = Callable[[Sequence[Algorithm], Event], Sequence[Algorithm]]
"""Composer's algorithm pass: the algorithms that match an event -> the ones to run, in order."""


_AFTER = frozenset(e for e in Event if e.is_after_event)


def filo_order(algorithms: Sequence[Algorithm], event: Event) -> Sequence[Algorithm]:
    """Composer's default pass: at the events that close a pair (``AFTER_LOSS``, ``BATCH_END``, ...;
    :attr:`Event.is_after_event`) algorithms run in reverse order, so that one that changed something
    at the opening event undoes it after the others."""
    return list(reversed(algorithms)) if event in _AFTER else algorithms


class Events:
    """Runs each event: matching algorithms first (ordered by ``passes``; with ``log_traces``, each
    event's algorithms are logged as ``algorithm_traces/<Algorithm>/<event>``), then the callbacks
    that act at it.

    ``before_weights_change`` is called before anything acts at an event, since an algorithm or a
    callback may change the weights there (a checkpoint's background copy may still read them).
    """

    def __init__(self, state: State, logger: Logger, algorithms: Sequence[Algorithm],
                 before_weights_change: Callable[[], None], *, passes: Sequence[AlgorithmPass] = (),
                 log_traces: bool = False) -> None:
        self.state, self.logger, self.algorithms = state, logger, algorithms
        self.before_weights_change = before_weights_change
        self.passes, self.log_traces = list(passes), log_traces
        """The user's passes, which run after Composer's default one (:func:`filo_order`)."""
        self.callbacks: CallbackList = CallbackList()
        state._callbacks = self.callbacks  # state.callbacks is the list that runs, as in Composer
        self.step_heard = False
        """Whether a callback acts at one of :data:`STEP_EVENTS`."""

    def set_callbacks(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = callbacks if isinstance(callbacks, CallbackList) else CallbackList(callbacks)
        self.state._callbacks = self.callbacks
        self._indexed_version = -1  # a CallbackList counts from 0: re-index at the next event

    def run(self, event: Event) -> None:
        handlers = self._handlers_of[event]
        if self.algorithms or handlers:
            self.before_weights_change()
        if self.algorithms:
            self._run_algorithms(event)
        if self._indexed_version != self.callbacks.version:
            self.index()  # the list changed (a callback added one, say): from this event on
            handlers = self._handlers_of[event]
        for handler in handlers:
            handler(self.state, self.logger)
        if self._indexed_version != self.callbacks.version:
            self.index()  # changed by a callback just now: the loop must know who listens

    def _run_algorithms(self, event: Event) -> None:
        state = self.state
        if not self.passes and not self.log_traces:  # every event of a step, with GradientClipping say
            for algorithm in reversed(self.algorithms) if event in _AFTER else self.algorithms:
                if algorithm.match(event, state):
                    algorithm.apply(event, state, self.logger)
            return
        matching: Sequence[Algorithm] = [a for a in self.algorithms if a.match(event, state)]
        if len(matching) > 1 and event in _AFTER:
            matching.reverse()  # filo_order, without a call: this runs at every event of every step
        for algorithm_pass in self.passes:
            matching = algorithm_pass(matching, event)
        for algorithm in matching:
            algorithm.apply(event, state, self.logger)
        if self.log_traces and matching:
            self.logger.log_traces({f"algorithm_traces/{type(a).__name__}/{event.value}": 1 for a in matching})

    def index(self) -> None:
        """Note what acts at each event."""
        self._handlers_of = {e: [_handler(c, e) for c in self.callbacks if c._listens_to(e)] for e in Event}
        self.step_heard = any(self._handlers_of[e] for e in STEP_EVENTS)
        self._indexed_version = self.callbacks.version

    def flush_logs(self) -> None:
        """Write what the run folder's logs keep in memory (they close with the Trainer)."""
        for callback in self.callbacks:
            if isinstance(callback, Buffered):
                try:
                    callback.flush()
                except Exception as e:  # noqa: BLE001 - the training error is the one to report
                    warnings.warn(f"{type(callback).__name__}.flush failed: {e}", stacklevel=2)

    def close(self) -> None:
        """Let every callback write what it holds, without hiding an error already on its way."""
        for callback in self.callbacks:
            try:
                callback.close(self.state, self.logger)
            except Exception as e:  # noqa: BLE001 - the training error is the one to report
                warnings.warn(f"{type(callback).__name__}.close failed: {e}", stacklevel=2)


def _handler(callback: Callback, event: Event) -> Callable[[State, Logger], None]:
    """What runs ``callback`` at ``event``: its method for the event, or its own ``run_event``."""
    if type(callback).run_event is Callback.run_event:
        method: Callable[[State, Logger], None] = getattr(callback, event.value)
        return method
    return functools.partial(callback.run_event, event)


class CallbackList(list[Callback]):
    """``trainer.callbacks``: a list that counts its changes, so that callbacks added or removed
    during ``fit`` take part from the next event on."""

    version = 0

    def _changed(self) -> None:
        self.version += 1


def _counting(name: str) -> Any:
    method = getattr(list, name)

    def change(self: CallbackList, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        self._changed()
        return self if name in ("__iadd__", "__imul__") else result

    change.__name__ = name
    return change


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",
              "__setitem__", "__delitem__", "__iadd__", "__imul__"):
    setattr(CallbackList, _name, _counting(_name))
