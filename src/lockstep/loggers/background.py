"""A worker thread that writes for a logger, so that logging costs the training step a queue put."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()


class BackgroundWriter:
    """Runs submitted calls in order on one daemon thread; a call that raises goes to ``on_error``
    (the thread keeps going). :meth:`flush` waits until everything submitted so far has run."""

    def __init__(self, name: str, on_error: Callable[[BaseException], None]) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._on_error = on_error
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args))

    def flush(self) -> None:
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        _lower_priority()
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                fn, args = item
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported; the writer must outlive a bad value
                self._on_error(e)
            finally:
                self._queue.task_done()


def _lower_priority() -> None:
    """On Linux a thread has its own nice value: the writer yields the cores to training."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
