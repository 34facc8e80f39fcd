"""The store a launcher hosts, served in the standard library alone: c10d's TCPStore wire protocol
on the server side, so that torch's clients (the ranks' ``init_process_group``, their process
groups, DeepSpeed's and DCP's own uses of the store) and :mod:`wire_store`'s see it as torch's.

A launcher that hosts the job's store (the master of several nodes, an elastic job, ``-c``) used
to import torch for it: 2-4 s of CPU on every such launch, before a rank could start, and a
launcher that a signal could stop only between two of torch's imports. Its own calls of the store
go straight to the table here, with torch's names, arguments and results.

The server follows c10d's libuv backend: a connection's first message is VALIDATE with the magic
number; a WAIT is answered once every key exists (a CANCEL_WAIT ends it early); GET, MULTI_GET and
QUEUE_POP never wait (a client waits first); ADD keeps the count as decimal text; every key is
as the client sent it (torch's client puts ``/`` in front of each). ``tests/launcher/
test_store_server.py`` runs every call of the installed torch's client against it, so a torch that
changes the protocol fails there.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections import deque
from collections.abc import Sequence

from lockstep.launcher import c10d_wire as wire
from lockstep.launcher.c10d_wire import as_bytes, framed

__all__ = ["StoreServer"]

_MAX_KEYS, _MAX_KEY, _MAX_PAYLOAD = 128 * 1024, 8 * 1024, 8 * 1024 * 1024  # c10d's limits
_TIMEOUT_S = 1800.0
"""How long the launcher's own get waits for a key, as the TCPStore it replaces did."""


class _Incomplete(Exception):
    """The message is not all there yet."""


class _BadMessage(Exception):
    """A message c10d's server would drop the connection for."""


class _Reader:
    def __init__(self, data: bytearray) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Incomplete
        out = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return out

    def value(self, fmt: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def bytes(self, limit: int) -> bytes:
        n = self.value("<Q")
        if n > limit:
            raise _BadMessage(f"a string of {n} bytes")
        return self.take(n)

    def count(self) -> int:
        n = self.value("<Q")
        if n > _MAX_KEYS:
            raise _BadMessage(f"{n} keys")
        return n

    def keys(self) -> list[bytes]:
        return [self.bytes(_MAX_KEY) for _ in range(self.count())]


class _Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.validated = False
        self.awaited = 0  # keys its WAIT still waits for


def _listen_everywhere() -> socket.socket:
    """A socket on a free port of every interface (IPv6 and IPv4 where the host has IPv6)."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
    sock.listen(socket.SOMAXCONN)
    return sock


class StoreServer:
    """c10d's store, served on a thread of this process: on ``listener`` (a listening socket the
    caller keeps and closes), or on a free port of every interface. ``port`` is where it listens.
    :meth:`set`, :meth:`get`, :meth:`add`, :meth:`check`, :meth:`compare_set`, :meth:`append`,
    :meth:`multi_get`, :meth:`delete_key` and :meth:`num_keys` are TCPStore's, for this process."""

    def __init__(self, listener: socket.socket | None = None) -> None:
        self._own_socket = listener is None
        self._listener = _listen_everywhere() if listener is None else listener
        self.port: int = self._listener.getsockname()[1]
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiting: dict[bytes, list[_Client]] = {}
        self._barriers: dict[bytes, list[tuple[_Client, int]]] = {}
        self._changed = threading.Condition()
        self._clients: dict[socket.socket, _Client] = {}
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="lockstep-store-server", daemon=True)
        self._thread.start()

    # -- this process's calls (torch's TCPStore's) ------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._set(wire.PREFIX + key.encode(), as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it exists (TimeoutError after the store's 1800 s)."""
        name = wire.PREFIX + key.encode()
        with self._changed:
            if not self._changed.wait_for(lambda: name in self._data, _TIMEOUT_S):
                raise TimeoutError(f"no key {key} within {_TIMEOUT_S:g} s")
            return self._data[name]

    def add(self, key: str, value: int) -> int:
        with self._changed:
            return self._add(wire.PREFIX + key.encode(), value)

    def check(self, keys: Sequence[str]) -> bool:
        with self._changed:
            return self._check([wire.PREFIX + k.encode() for k in keys])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._changed:
            return self._compare_set(wire.PREFIX + key.encode(), as_bytes(expected), as_bytes(desired))

    def append(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._append(wire.PREFIX + key.encode(), as_bytes(value))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(wire.PREFIX + key.encode(), None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)

    def close(self) -> None:
        """Stop serving: every client's connection closes (the listener stays the caller's)."""
        with self._changed:
            self._closed = True
        self._poke()
        self._thread.join(5)

    # -- the table (under the lock) ----------------------------------------------------------------

    def _set(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake_waiters(key)

    def _add(self, key: bytes, value: int) -> int:
        total = value + int(self._data.get(key, b"0"))
        self._set(key, str(total).encode())
        return total

    def _check(self, keys: Sequence[bytes]) -> bool:
        return all(k in self._data or self._queues.get(k) for k in keys)

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self._data.get(key)
        if current is None and expected:
            self._wake_waiters(key)
            return expected  # as c10d's: the expected value, for a key that does not exist
        if current is None or current == expected:
            self._set(key, desired)
            return desired
        self._wake_waiters(key)
        return current

    def _append(self, key: bytes, value: bytes) -> None:
        self._set(key, self._data.get(key, b"") + value)

    def _wake_waiters(self, key: bytes, one: bool = False) -> None:
        self._changed.notify_all()
        for client in self._waiting.get(key, []):
            client.awaited -= 1
            if client.awaited == 0:
                self._reply(client, bytes([wire.STOP_WAITING]))
                if one:
                    self._waiting[key].remove(client)
                    return
        self._waiting.pop(key, None)

    def _reply(self, client: _Client, data: bytes) -> None:
        client.outbox += data
        try:
            sent = client.sock.send(client.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # gone: the serving thread drops it
        del client.outbox[:sent]
        if client.outbox:
            self._poke()  # the serving thread writes the rest when the socket can take it

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    # -- the serving thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while True:
                with self._changed:
                    if self._closed:
                        return
                    for client in self._clients.values():
                        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbox else 0)
                        if self._selector.get_key(client.sock).events != events:
                            self._selector.modify(client.sock, events)
                for key, mask in self._selector.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                    elif (client := self._clients.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                        self._serve_client(client, mask)
        finally:
            self._shut()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # the listener closed under us, or a connection reset before accept
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._changed:
                self._clients[sock] = _Client(sock)
            self._selector.register(sock, selectors.EVENT_READ)

    def _serve_client(self, client: _Client, mask: int) -> None:
        with self._changed:
            try:
                if mask & selectors.EVENT_WRITE and client.outbox:
                    del client.outbox[:client.sock.send(client.outbox)]
                if mask & selectors.EVENT_READ:
                    data = client.sock.recv(65536)
                    if not data:
                        raise ConnectionResetError("closed by the client")
                    client.inbox += data
                    self._handle_all(client)
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, _BadMessage, ValueError):
                self._drop(client)

    def _handle_all(self, client: _Client) -> None:
        while client.inbox:
            reader = _Reader(client.inbox)
            try:
                self._handle(client, reader)
            except _Incomplete:
                return
            del client.inbox[:reader.pos]

    def _handle(self, client: _Client, r: _Reader) -> None:
        query = r.value("<B")
        if not client.validated:
            if query != wire.VALIDATE or r.value("<I") != wire.MAGIC:
                raise _BadMessage("a connection that did not begin with c10d's VALIDATE")
            client.validated = True
        elif query == wire.PING:
            self._reply(client, r.take(4))
        elif query == wire.SET:
            self._set(r.bytes(_MAX_KEY), r.bytes(_MAX_PAYLOAD))
        elif query == wire.COMPARE_SET:
            key, expected, desired = r.bytes(_MAX_KEY), r.bytes(_MAX_PAYLOAD), r.bytes(_MAX_PAYLOAD)
            self._reply(client, framed(self._compare_set(key, expected, desired)))
        elif query == wire.GET:
            self._reply(client, framed(self._data.get(r.bytes(_MAX_KEY), b"")))
        elif query == wire.ADD:
            key = r.bytes(_MAX_KEY)
            self._reply(client, struct.pack("<q", self._add(key, r.value("<q"))))
        elif query == wire.CHECK:
            self._reply(client, bytes([wire.READY if self._check(r.keys()) else wire.NOT_READY]))
        elif query == wire.WAIT:
            self._wait(client, r.keys())
        elif query == wire.NUM_KEYS:
            self._reply(client, struct.pack("<q", len(self._data)))
        elif query == wire.DELETE_KEY:
            self._reply(client, struct.pack("<q", int(self._data.pop(r.bytes(_MAX_KEY), None) is not None)))
        elif query == wire.APPEND:
            self._append(r.bytes(_MAX_KEY), r.bytes(_MAX_PAYLOAD))
        elif query == wire.MULTI_GET:
            self._reply(client, b"".join(framed(self._data.get(k, b"")) for k in r.keys()))
        elif query == wire.MULTI_SET:
            for _ in range(r.count()):
                self._set(r.bytes(_MAX_KEY), r.bytes(_MAX_PAYLOAD))
        elif query == wire.CANCEL_WAIT:
            self._forget_waits(client)
            self._reply(client, bytes([wire.WAIT_CANCELED]))
        else:
            self._handle_queues(client, query, r)

    def _handle_queues(self, client: _Client, query: int, r: _Reader) -> None:
        if query == wire.QUEUE_PUSH:
            key = r.bytes(_MAX_KEY)
            self._queues.setdefault(key, deque()).append(r.bytes(_MAX_PAYLOAD))
            self._wake_waiters(key, one=True)
        elif query == wire.QUEUE_POP:
            queue = self._queues.setdefault(r.bytes(_MAX_KEY), deque())
            self._reply(client, struct.pack("<q", len(queue)) + (framed(queue.popleft()) if queue else b""))
        elif query == wire.QUEUE_LEN:
            self._reply(client, struct.pack("<q", len(self._queues.get(r.bytes(_MAX_KEY), ()))))
        elif query == wire.LIST_KEYS:
            self._reply(client, struct.pack("<q", len(self._data)) + b"".join(framed(k) for k in self._data))
        elif query == wire.BARRIER:
            self._barrier(client, r.bytes(_MAX_KEY), r.value("<q"))
        else:
            raise _BadMessage(f"unknown query {query}")

    def _wait(self, client: _Client, keys: list[bytes]) -> None:
        if self._check(keys):
            self._reply(client, bytes([wire.STOP_WAITING]))
            return
        missing = [k for k in keys if k not in self._data]
        for key in missing:
            self._waiting.setdefault(key, []).append(client)
        client.awaited = len(missing)

    def _barrier(self, client: _Client, key: bytes, world_size: int) -> None:
        """A client's arrival at the barrier ``key`` (counted in the key, as c10d does): answered
        once ``world_size`` clients have arrived, at once from then on."""
        arrived = self._add(key, 1)
        waiting = self._barriers.setdefault(key, [])
        waiting.append((client, world_size))
        for waiter in [w for w in waiting if arrived >= w[1]]:
            waiting.remove(waiter)
            self._reply(waiter[0], bytes([0]))

    def _forget_waits(self, client: _Client) -> None:
        client.awaited = 0
        for key, waiting in self._barriers.items():
            self._barriers[key] = [w for w in waiting if w[0] is not client]
        for key in list(self._waiting):
            self._waiting[key] = [c for c in self._waiting[key] if c is not client]
            if not self._waiting[key]:
                del self._waiting[key]

    def _drop(self, client: _Client) -> None:
        self._forget_waits(client)
        self._clients.pop(client.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        client.sock.close()

    def _shut(self) -> None:
        with self._changed:
            for client in list(self._clients.values()):
                self._drop(client)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._own_socket:
            self._listener.close()

