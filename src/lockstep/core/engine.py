"""Engine: runs the algorithms and callbacks of a :class:`~lockstep.state.State` at each event, as
Composer's ``composer.core.Engine``.

At ``INIT`` the logger destinations run first, then the other callbacks, then the algorithms (so
that a destination is ready before anything logs); at every other event the algorithms that
match run first (in reverse at an event that closes a pair: Composer's FILO rule, then the
user's passes), then the callbacks, then the destinations. ``run_event`` returns the algorithms'
traces. An engine is closed once (``close()``, its deletion, or the interpreter's exit): every
callback's ``close`` then ``post_close``; after that it refuses events.

The Trainer runs its events through :class:`lockstep.trainer.events.Events`, the same order
indexed for speed; this class is for code that drives a State by hand (Composer's tests of
callbacks and algorithms do).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockstep.core.event import Event

if TYPE_CHECKING:
    from lockstep.core.algorithm import Algorithm
    from lockstep.core.log import Logger
    from lockstep.core.state import State

log = logging.getLogger(__name__)

AlgorithmPass = Callable[[Sequence["Algorithm"], Event], Sequence["Algorithm"]]

_NEED_NO_DATALOADER = frozenset((Event.INIT, Event.BEFORE_LOAD, Event.AFTER_LOAD, Event.EVAL_STANDALONE_START,
                                 Event.EVAL_STANDALONE_END))
_open_callbacks: weakref.WeakSet[Any] = weakref.WeakSet()
"""Callbacks an engine has started (INIT) and not yet closed: one cannot serve two engines at once."""


@dataclass
class Trace:
    """An algorithm's run at an event: ``order`` among those that ran, the ``exit_code`` its
    ``apply`` returned."""

    name: str = ""
    event: Event | None = None
    exit_code: int | None = None
    order: int | None = None
    run: bool = False


Traces = dict[str, Trace]


def filo(algorithms: Sequence[Algorithm], event: Event) -> Sequence[Algorithm]:
    """Composer's default pass: reverse order at an event that closes a pair."""
    return list(reversed(algorithms)) if event.is_after_event else algorithms


class Engine:
    """Runs ``state``'s algorithms and callbacks at each event (see the module's docstring)."""

    def __init__(self, state: State, logger: Logger,
                 algorithm_passes: AlgorithmPass | Sequence[AlgorithmPass] | None = None) -> None:
        self.state, self.logger = state, logger
        self._is_closed = False
        self._started = False
        """Whether its INIT ran: only then does its deletion close the callbacks (another engine may own them)."""
        self.algorithm_passes: list[AlgorithmPass] = [filo]
        if algorithm_passes is not None:
            for algorithm_pass in algorithm_passes if isinstance(algorithm_passes, Sequence) else [algorithm_passes]:
                self.register_pass(algorithm_pass)
        # Not a bound method: the engine itself can still be collected (and closed) before the exit.
        self._at_exit = functools.partial(Engine._close, state, logger)
        atexit.register(self._at_exit)

    def register_pass(self, algorithm_pass: AlgorithmPass, index: int = -1) -> None:
        """Add a pass (matching algorithms, event -> the ones to run, in order) at ``index`` (-1: last)."""
        self.algorithm_passes.insert(len(self.algorithm_passes) if index == -1 else index, algorithm_pass)

    def run_event(self, event: Event | str) -> Traces:
        """Run everything that acts at ``event`` (an Event or its name); the algorithms' traces,
        keyed ``'<algorithm>/<event>'``."""
        event = Event(str(event).lower())
        self._debug(event, "Running event")
        if self._is_closed:
            raise RuntimeError("this Engine was closed and cannot run events: create a new Engine (or Trainer)")
        self._check_state(event)
        if event is Event.INIT:
            self._claim_callbacks()
            self._started = True
            self._run_callbacks(event, loggers=True)
            self._run_callbacks(event, loggers=False)
            return self._run_algorithms(event)
        traces = self._run_algorithms(event)
        self._run_callbacks(event, loggers=False)
        self._run_callbacks(event, loggers=True)
        return traces

    def _check_state(self, event: Event) -> None:
        if event not in _NEED_NO_DATALOADER and self.state.dataloader is None:
            raise AssertionError(f"state.dataloader must be set before the {event.name} event (state.set_dataloader)")
        if (event not in (Event.INIT, Event.BEFORE_LOAD, Event.AFTER_LOAD) and not event.is_eval
                and not event.is_predict and self.state.max_duration is None):
            raise AssertionError(f"state.max_duration must be set before the {event.name} event")

    def _claim_callbacks(self) -> None:
        for callback in self.state.callbacks:
            if callback in _open_callbacks:
                raise RuntimeError("Cannot create a new trainer with an open callback or logger from a previous "
                                   "trainer: call close() on the previous Trainer (or Engine) first")
            _open_callbacks.add(callback)

    def _run_algorithms(self, event: Event) -> Traces:
        state = self.state
        matching: Sequence[Algorithm] = [a for a in state.algorithms if a.match(event, state)]
        for algorithm_pass in self.algorithm_passes:
            matching = algorithm_pass(matching, event)
        traces: Traces = OrderedDict()
        for order, algorithm in enumerate(matching):
            self._debug(event, f"Running algorithm {type(algorithm).__name__}")
            exit_code = algorithm.apply(event, state, self.logger)
            traces[f"{algorithm}/{event}"] = Trace(type(algorithm).__name__, event, exit_code, order, True)
        if traces:
            self.logger.log_traces({f"algorithm_traces/{t.name}/{t.event}": 1 for t in traces.values()})
        return traces

    def _run_callbacks(self, event: Event, *, loggers: bool) -> None:
        # Without lockstep.loggers imported, no callback can be a destination (and the loop's
        # vocabulary does not import the layer of destinations).
        destinations = sys.modules.get("lockstep.loggers.logger_destination")
        kind = destinations.LoggerDestination if destinations is not None else ()
        for callback in list(self.state.callbacks):
            if isinstance(callback, kind) is loggers:
                self._debug(event, f"Running callback {type(callback).__name__}")
                callback.run_event(event, self.state, self.logger)

    def _debug(self, event: Event, message: str) -> None:
        if os.environ.get("ENGINE_DEBUG"):
            t = self.state.timestamp
            where = f"[ep={int(t.epoch)}][ba={int(t.batch)}]"
            if event.is_eval:
                where += f"[eval_ba={int(self.state.eval_timestamp.batch)}]"
            if event.is_predict:
                where += f"[predict_ba={int(self.state.predict_timestamp.batch)}]"
            log.debug(f"{where}[event={event.name}]: {message}")

    def close(self) -> None:
        """Close every callback (``close``, then ``post_close`` for those whose ``close`` did not
        raise); errors are logged, not raised. Only the first call does anything."""
        if not self._is_closed:
            atexit.unregister(self._at_exit)
            Engine._close(self.state, self.logger)
        self._is_closed = True

    def __del__(self) -> None:
        if getattr(self, "_is_closed", True):
            return
        if self._started:
            self.close()
        else:
            atexit.unregister(self._at_exit)

    @staticmethod
    def _close(state: State, logger: Logger) -> None:
        log.debug("Closing the engine.")
        closed = []
        for callback in state.callbacks:
            try:
                log.debug("Closing callback %s", type(callback).__name__)
                callback.close(state, logger)
            except Exception as e:  # noqa: BLE001 - closing the others matters more
                log.error(f"{type(callback).__name__}.close() failed: {e}; its post_close() is skipped",
                          exc_info=e)
            else:
                closed.append(callback)
        for callback in closed:
            try:
                log.debug("Post-closing callback %s", type(callback).__name__)
                callback.post_close()
            except Exception as e:  # noqa: BLE001
                log.error(f"{type(callback).__name__}.post_close() failed: {e}", exc_info=e)
            else:
                _open_callbacks.discard(callback)
        log.debug("Engine closed.")
