"""A client of torch's TCPStore in the standard library alone: c10d's wire protocol, for the calls
the launchers make of each other's store.

A launcher whose node does not host the job's store (every node but the master's) would otherwise
import torch only to be a store client: about 1.8 s of CPU, before its ranks can start. The
messages are c10d's own (one VALIDATE with the magic number per connection, then a query byte and
its arguments: strings and values as a little-endian u64 length and the bytes, counts as u64,
increments as i64), and keys carry the ``/`` that torch's client puts in front of every key, so
this client and torch's see the same keys in the same server.

:func:`connect` checks the protocol at once with a PING, whose nonce the server must send back; a
server that answers otherwise (a torch that changed its protocol) gets torch's own client instead.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from lockstep.launcher import c10d_wire as wire
from lockstep.launcher.c10d_wire import PREFIX, framed

__all__ = ["WireStore", "connect"]



class ProtocolMismatch(ConnectionError):
    """The server did not answer a PING as c10d's store does."""


class _Closed(ConnectionError):
    """The server closed the connection."""


class WireStore:
    """The calls of torch's ``TCPStore`` that the launchers make (``set``, ``get``, ``add``,
    ``check``, ``compare_set``, ``append``, ``multi_get``), with the same arguments and results.
    One call at a time; a failed call leaves the connection unusable (the caller gives it up)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.timeout = timeout
        deadline, pause = time.monotonic() + timeout, 0.05
        while True:
            try:
                self._handshake(host, port)
                return
            except ProtocolMismatch:
                raise
            except (ConnectionResetError, BrokenPipeError, _Closed):
                # c10d's server may drop a connection as it is made on a loaded machine; torch's
                # client connects again, and so does this one (nothing was asked yet)
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.5)

    def _handshake(self, host: str, port: int) -> None:
        """Connect, validate and ping; the socket is closed if any of it fails."""
        self._sock = socket.create_connection((host, port), timeout=self.timeout)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = int.from_bytes(os.urandom(4), "little")
            self._send(struct.pack("<BI", wire.VALIDATE, wire.MAGIC) + struct.pack("<BI", wire.PING, nonce))
            if struct.unpack("<I", self._recv(4))[0] != nonce:
                raise ProtocolMismatch(f"{host}:{port} did not answer a c10d PING")
        except BaseException:
            self._sock.close()
            raise

    def set(self, key: str, value: str | bytes) -> None:
        self._send(bytes([wire.SET]) + _key(key) + framed(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it exists (within the timeout, as torch's client waits)."""
        self._wait([key])
        self._send(bytes([wire.GET]) + _key(key))
        return self._recv_bytes()

    def add(self, key: str, value: int) -> int:
        self._send(bytes([wire.ADD]) + _key(key) + struct.pack("<q", value))
        return struct.unpack("<q", self._recv(8))[0]

    def check(self, keys: Sequence[str]) -> bool:
        self._send(bytes([wire.CHECK]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys))
        return self._recv(1)[0] == wire.READY

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._send(bytes([wire.COMPARE_SET]) + _key(key) + framed(expected) + framed(desired))
        return self._recv_bytes()

    def append(self, key: str, value: str | bytes) -> None:
        self._send(bytes([wire.APPEND]) + _key(key) + framed(value))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._wait(keys)
        self._send(bytes([wire.MULTI_GET]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys))
        return [self._recv_bytes() for _ in keys]

    def close(self) -> None:
        self._sock.close()

    def _wait(self, keys: Sequence[str]) -> None:
        """Until every key exists; past the timeout, the wait is cancelled and TimeoutError raised."""
        self._send(bytes([wire.WAIT]) + struct.pack("<Q", len(keys)) + b"".join(_key(k) for k in keys))
        try:
            answer = self._recv(1)[0]
        except TimeoutError:
            self._send(bytes([wire.CANCEL_WAIT]))
            # the keys may have come just before the cancel: then STOP_WAITING comes first
            while self._recv(1)[0] != wire.WAIT_CANCELED:
                pass
            raise TimeoutError(f"no key {', '.join(keys)} within {self.timeout:g} s") from None
        if answer != wire.STOP_WAITING:
            raise ConnectionError(f"unexpected answer {answer} to a c10d WAIT")

    def _send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self._sock.recv(n - len(data))
            if not chunk:
                raise _Closed("the store closed the connection")
            data += chunk
        return data

    def _recv_bytes(self) -> bytes:
        return self._recv(struct.unpack("<Q", self._recv(8))[0])


def _key(key: str) -> bytes:
    return framed(PREFIX + key.encode())


def connect(host: str, port: int, timeout: float, fallback: Callable[[], Any]) -> Any:
    """A :class:`WireStore` on host:port, or ``fallback()`` (torch's client) where the server does
    not speak the protocol this module knows."""
    try:
        return WireStore(host, port, timeout)
    except ProtocolMismatch:
        return fallback()
