"""The launchers' access to the rendezvous store (c10d's TCPStore protocol: :mod:`wire_store`'s
client, :mod:`store_server`'s server), with a deadline on every call.

A client may wait for an answer forever when the master's host is cut off (torch's timeout covers
waiting for keys, not a network that drops packets silently), and a launcher blocked in it would
stop draining its ranks' output and handling signals. So :class:`StoreClient` runs the calls on a
thread of its own, while the caller waits for the answer through a ``meanwhile`` hook that does the
main thread's other work (the supervisor's drains output and catches signals; a stopping signal
abandons the wait: :class:`Stopped`, while the call itself goes on, so that the signal can still be
recorded for the other nodes behind it). A call not answered within ``CALL_S``, or failed, makes the
client lost for good (:class:`StoreLost`); a node that restarts connects again.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lockstep.launcher.store_server import StoreServer

if TYPE_CHECKING:
    from torch.distributed import TCPStore

CALL_S = 10.0
"""A store call not answered within this long: the store (the master) counts as lost."""
_SLICE_S = 0.1  # the longest the main thread leaves output and signals alone while a call is out


class StoreLost(RuntimeError):
    """The store (the master's launcher) stopped answering."""


class Stopped(Exception):
    """A stopping signal came while the launcher waited for the store (raised by the ``meanwhile`` hook)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


Meanwhile = Callable[[float], None]
"""Waits up to the given seconds while a store call is out, doing the main thread's other work;
raises :class:`Stopped` when a stopping signal comes."""


def idle(seconds: float) -> None:
    time.sleep(seconds)


class StoreClient:
    """A store whose every call ends within ``CALL_S``, answered or not.

    The calls run one at a time on a daemon thread. Past the deadline the client is given up: the
    thread may stay blocked for good (in a socket read, or in torch's C++ client where that is the
    one in use: it holds no lock and no GIL meanwhile), and
    every later call raises :class:`StoreLost` at once.
    """

    def __init__(self, connect: Callable[[], Any], where: str, deadline: float = CALL_S) -> None:
        self._connect, self.where, self._deadline = connect, where, deadline
        self._store: Any = None
        self._jobs: queue.SimpleQueue[tuple[str, tuple[Any, ...], list[Any], threading.Event]] = queue.SimpleQueue()
        self.lost: str | None = None
        self.last_answer = time.time()
        """Wall-clock time of the last answer: since when the store is silent, once lost."""
        threading.Thread(target=self._serve, name=f"lockstep-store-{where}", daemon=True).start()

    def _serve(self) -> None:
        try:  # connecting counts towards the first call's deadline
            self._store = self._connect()
        except Exception as e:  # noqa: BLE001
            self._store = e
        while True:
            name, args, box, done = self._jobs.get()
            try:
                if isinstance(self._store, Exception):
                    raise self._store
                box.append((True, getattr(self._store, name)(*args)))
            except Exception as e:  # noqa: BLE001 - torch raises several kinds for a lost connection
                box.append((False, e))
            done.set()

    def call(self, name: str, *args: Any, meanwhile: Meanwhile = idle) -> Any:
        if self.lost is not None:
            raise StoreLost(self.lost)
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((name, args, box, done))
        deadline = time.monotonic() + self._deadline
        pause = 0.001  # most answers come within a millisecond or two: look again soon, then less often
        while not done.wait(pause):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.lost = f"no answer within {self._deadline:g} s"
                raise StoreLost(self.lost)
            pause = min(2 * pause, _SLICE_S, remaining)
            meanwhile(pause)  # Stopped: the call goes on in the thread, and a next one waits behind it
        ok, value = box[0]
        if not ok:
            self.lost = str(value).splitlines()[0] if str(value) else type(value).__name__
            raise StoreLost(self.lost)
        self.last_answer = time.time()
        return value


_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"


def tcp_store() -> type[TCPStore]:
    """torch's TCPStore class, for the launcher's own use.

    The launcher reports a store that fails in one line (StoreLost); c10d would first log each
    failed call as a C++ warning with a backtrace, from every thread that had one in flight. c10
    reads TORCH_CPP_LOG_LEVEL once, when torch loads: unless the user set it, the launcher loads
    torch with ERROR and removes the variable again, so that the ranks it starts later keep theirs.
    """
    if "torch" not in sys.modules and _CPP_LOG_LEVEL not in os.environ:
        os.environ[_CPP_LOG_LEVEL] = "ERROR"
        try:
            import torch.distributed  # noqa: F401
        finally:
            del os.environ[_CPP_LOG_LEVEL]
    from torch.distributed import TCPStore as store_class

    return store_class


def host_store(listener: socket.socket | None = None) -> StoreServer:
    """The c10d store this launcher hosts (:class:`StoreServer`, torch not imported): on
    ``listener``'s socket (-c runs commands that do not host one; a multi-node job's store
    outlives its ranks), or on a free port of every interface (the ranks of a restart)."""
    return StoreServer(listener)


def own_address(listener: socket.socket | None) -> str:
    """The address this launcher reaches the store it hosts at: the one its socket is bound to,
    the loopback address where it listens on every interface (or hosts no socket)."""
    host = listener.getsockname()[0] if listener is not None else "0.0.0.0"
    if ipaddress.ip_address(host.split("%", 1)[0]).is_unspecified:
        return "::1" if ":" in host else "127.0.0.1"
    return host
