"""A worker thread that writes for a logger, so that logging costs the training step a queue put."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lockstep import idle
from lockstep.loggers.logger import report_failure
from lockstep.loggers.logger_destination import LoggerDestination

if TYPE_CHECKING:
    from lockstep.state import State

_STOP = object()


class BackgroundWriter:
    """Runs submitted calls in order on one daemon thread; a call that raises goes to ``on_error``
    (the thread keeps going). :meth:`flush` waits until everything submitted so far has run."""

    def __init__(self, name: str, on_error: Callable[[BaseException], None]) -> None:
        # SimpleQueue: a put is a few hundred nanoseconds on the training thread, a tenth of Queue's
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_error = on_error
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args))

    def flush(self) -> None:
        if self._thread.is_alive():
            done = threading.Event()
            self._queue.put((done.set, ()))
            while not done.wait(0.1) and self._thread.is_alive():
                pass

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        idle.yield_to_training()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                fn, args = item
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported; the writer must outlive a bad value
                self._on_error(e)


class ThreadedDestination(LoggerDestination):
    """A destination that does its writing on a :class:`BackgroundWriter`: subclasses call
    :meth:`_start` at INIT (on the ranks that log), then :meth:`_submit` for every write, and give
    what to do to flush (:meth:`_flush_work`) and to finish (:meth:`_close_work`) on the thread.
    Flushed at each evaluation and at FIT_END; finished by :meth:`close` (``Trainer.close()``)."""

    _thread: BackgroundWriter | None = None

    def _start(self, name: str) -> None:
        self._failed: set[int] = set()
        self._thread = BackgroundWriter(name, lambda e: report_failure(self, e, self._failed))

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._thread is not None:
            self._thread.submit(fn, *args)

    def _flush_work(self) -> None:
        """Runs on the thread: push what was written so far out to its store."""

    def _close_work(self) -> None:
        """Runs on the thread, last: end the run, close files."""

    def flush(self) -> None:
        if self._thread is not None:
            self._thread.submit(self._flush_work)
            self._thread.flush()

    def eval_end(self, state: State, logger: Any = None) -> None:
        self.flush()

    def fit_end(self, state: State, logger: Any = None) -> None:
        self.flush()

    def close(self, state: State, logger: Any = None) -> None:
        if self._thread is not None:
            self._thread.submit(self._flush_work)
            self._thread.submit(self._close_work)
            self._thread.close()
            self._thread = None
