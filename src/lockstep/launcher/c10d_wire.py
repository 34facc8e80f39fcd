"""c10d's TCPStore wire protocol: the numbers and the framing that :mod:`wire_store` (a client) and
:mod:`store_server` (a server) share with torch's own client and server."""

from __future__ import annotations

import struct

MAGIC = 0x3C85F7CE
"""What a connection's first message, VALIDATE, carries."""
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, NUM_KEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET,
 CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS, BARRIER) = range(19)  # QueryType
READY, NOT_READY = 0, 1  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType
PREFIX = b"/"
"""What torch's client puts in front of every key."""


def as_bytes(value: str | bytes) -> bytes:
    """A key's value as the store keeps it (torch's clients take str or bytes)."""
    return value.encode() if isinstance(value, str) else bytes(value)


def framed(value: str | bytes) -> bytes:
    """A string or value as the protocol sends it: a little-endian u64 length, then the bytes."""
    data = as_bytes(value)
    return struct.pack("<Q", len(data)) + data
