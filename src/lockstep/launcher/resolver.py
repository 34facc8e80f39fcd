"""Name lookups with a deadline.

``socket.getaddrinfo`` blocks in the C library for as long as the resolver retries: with a DNS
server that does not answer, a minute and more per name, during which the launcher's main thread
neither handles a signal nor gives up. Here each lookup runs on a daemon thread, and the caller
waits at most ``deadline`` seconds (and stops waiting as soon as ``interrupted()`` says so); a
lookup still out then is left to finish on its own.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

RESOLVE_S = 10.0
_STEP_S = 0.1


class Unresolved(OSError):
    """The name did not resolve: no answer within the deadline, or the resolver's error."""

    def __init__(self, host: str, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(f"{host!r} {detail}")
        self.host, self.detail, self.timed_out = host, detail, timed_out


def getaddrinfo(host: str, port: int | None, family: int = 0, kind: int = 0, *, deadline: float = RESOLVE_S,
                interrupted: Callable[[], bool] | None = None) -> list[tuple[Any, ...]]:
    """``socket.getaddrinfo(host, port, family, kind)`` within ``deadline`` seconds; an
    :class:`Unresolved` naming ``host`` otherwise (also when ``interrupted()`` turned true)."""
    found: list[Any] = []

    def look_up() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, family, kind))
        except (OSError, UnicodeError) as e:  # UnicodeError: a label longer than 63 characters
            found.append(e)

    thread = threading.Thread(target=look_up, name="lockstep-resolve", daemon=True)
    thread.start()
    until = time.monotonic() + deadline
    while thread.is_alive() and time.monotonic() < until and not (interrupted and interrupted()):
        thread.join(min(_STEP_S, max(0.0, until - time.monotonic())))
    if not found:
        raise Unresolved(host, f"did not resolve within {deadline:g} s (no answer from the name server)",
                         timed_out=True)
    if isinstance(found[0], BaseException):
        raise Unresolved(host, f"does not resolve ({found[0]})")
    return found[0]
