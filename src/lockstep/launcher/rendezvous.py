"""Waiting for the master's rendezvous store, with a deadline, before a node starts its ranks.

A node without global rank 0 would otherwise start ranks that block inside torch: the c10d client
retries a refused connection for its own long timeout, and against a listener that accepts but
never answers (a port held by some other program) it can wait forever. The launcher therefore
asks the store itself first, with the two messages of the c10d wire protocol every TCPStore
server (classic and libuv) answers: VALIDATE with the magic number, then PING, whose nonce the
store sends back. Only the standard library is used, so the launcher still never imports torch.
"""

from __future__ import annotations

import enum
import os
import socket
import struct
import time
from collections.abc import Callable

from lockstep.launcher import resolver

_VALIDATE, _PING = 0, 13  # c10d::detail::QueryType
_MAGIC = 0x3C85F7CE
_STEP = 0.25  # seconds between checks for a signal while waiting
TELL_S = 5.0
"""Seconds between a waiting launcher's lines saying what it waits for."""


class StoreState(enum.Enum):
    READY = "ready"
    NOTHING_LISTENS = "nothing listens"
    UNRESOLVED = "the name does not resolve"
    NO_ANSWER = "no answer"
    FOREIGN = "foreign"
    INTERRUPTED = "interrupted"


def wait_for_store(host: str, port: int, timeout: float, interrupted: Callable[[], bool],
                   tell: Callable[[str], None] | None = None) -> StoreState:
    """Wait until a c10d store answers at host:port, at most ``timeout`` seconds; every
    :data:`TELL_S` seconds ``tell`` gets a line saying what it waits for and why it still waits."""
    start = time.monotonic()
    deadline, told = start + timeout, start
    accepted, resolved = False, False
    while not interrupted():
        if tell is not None and time.monotonic() - told >= TELL_S:
            told = time.monotonic()
            state = StoreState.NO_ANSWER if accepted else StoreState.NOTHING_LISTENS if resolved \
                else StoreState.UNRESOLVED
            tell(f"waiting for the master's rendezvous store at {host}:{port} ({_WHY[state]}): "
                 f"{told - start:.0f} s of {timeout:g} s (--rdzv_timeout)")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return StoreState.NO_ANSWER if accepted else StoreState.NOTHING_LISTENS if resolved \
                else StoreState.UNRESOLVED
        try:  # each time: the master's name may come to resolve (a DNS record being published)
            address = resolver.getaddrinfo(host, port, kind=socket.SOCK_STREAM, interrupted=interrupted,
                                           deadline=min(remaining, resolver.RESOLVE_S))[0][4][:2]
            resolved = True
            sock = socket.create_connection(address, timeout=min(remaining, 2.0))
        except OSError:
            time.sleep(min(_STEP, max(0.0, deadline - time.monotonic())))
            continue
        accepted = True
        with sock:
            state = _ping(sock, deadline, interrupted)
        if state is not None:
            return state
        time.sleep(min(_STEP, max(0.0, deadline - time.monotonic())))
    return StoreState.INTERRUPTED


def _ping(sock: socket.socket, deadline: float, interrupted: Callable[[], bool]) -> StoreState | None:
    """READY or FOREIGN from the answer; None when the peer closed without answering."""
    nonce = int.from_bytes(os.urandom(4), "little")
    try:
        sock.sendall(struct.pack("=BI", _VALIDATE, _MAGIC) + struct.pack("=BI", _PING, nonce))
    except OSError:
        return None
    answer = b""
    while len(answer) < 4:
        if interrupted():
            return StoreState.INTERRUPTED
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return StoreState.NO_ANSWER
        sock.settimeout(min(_STEP, remaining))
        try:
            chunk = sock.recv(4 - len(answer))
        except TimeoutError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        answer += chunk
    return StoreState.READY if struct.unpack("=I", answer)[0] == nonce else StoreState.FOREIGN


_WHY = {StoreState.UNRESOLVED: "its name does not resolve yet",
        StoreState.NOTHING_LISTENS: "nothing accepts connections there yet",
        StoreState.NO_ANSWER: "it accepts connections but has not answered as a store"}


def describe(state: StoreState, host: str, port: int, timeout: float) -> str:
    """The one line the launcher prints when the store could not be reached."""
    where = f"{host}:{port}"
    if state is StoreState.UNRESOLVED:
        return (f"the master's name {host!r} did not resolve on this host within {timeout:g} s (the name "
                f"server gave no address, or no answer): give --master_addr an address, or a name this host "
                f"resolves")
    if state is StoreState.NOTHING_LISTENS:
        return (f"no rendezvous store at {where} after {timeout:g} s: nothing accepts connections "
                f"there; start the node_rank 0 launcher, check --master_addr/--master_port, or wait "
                f"longer with --rdzv_timeout")
    if state is StoreState.FOREIGN:
        return (f"{where} is held by something that is not lockstep's rendezvous store (it answered "
                f"a c10d ping with other bytes): check --master_addr/--master_port")
    return (f"{where} accepts connections but did not answer as a c10d store within {timeout:g} s: "
            f"the port is held by something that is not lockstep's store, or rank 0 on the master "
            f"never started it; check --master_addr/--master_port, or wait longer with --rdzv_timeout")
