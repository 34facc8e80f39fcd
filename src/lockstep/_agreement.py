"""lockstep's own collectives for distributed decisions (internal: not Composer's ``dist`` API).

The library decides as probe -> agree -> decide -> act: each rank gathers small local facts, one
collective gives every rank all of them (:func:`gather_small_objects`), a pure function decides the
same on every rank, and only then does any rank act. :func:`first_error` and
:func:`raise_first_error` are the agreement on success, or on the first failing rank's error,
raised everywhere. :func:`host_group` is the gloo group these small CPU collectives (and other
off-the-critical-path reductions) run over.

Stalls: these collectives never pause a rank's progress reports, so a rank that stops before one
is caught by ``--stall_timeout`` while the others wait in it. What may keep them waiting
legitimately, a rank's long local work (a checkpoint write), runs in :func:`long_io`: a counter in
the job's store, which a rank waiting here reads, on any node, to pause its own reports meanwhile.

Built on :mod:`lockstep.dist`, which does not import this module.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

from lockstep import dist, progress

T = TypeVar("T")

_host_group: tuple[torch_dist.ProcessGroup, torch_dist.ProcessGroup] | None = None
"""(the default group it was made for, the gloo group)."""


def host_group() -> torch_dist.ProcessGroup | None:
    """A group for small CPU tensors the library reduces off the critical path: the default group
    when it is gloo, else a gloo group over every rank, made at the first call after the default
    group was (a collective: every rank makes that call at the same point)."""
    global _host_group
    default = torch_dist.distributed_c10d._get_default_group()
    if torch_dist.get_backend() == "gloo":
        return None
    if _host_group is None or _host_group[0] is not default:
        _host_group = (default, torch_dist.new_group(backend="gloo"))
    return _host_group[1]


_small_object_bytes = 1 << 14
"""The room for one rank's object in :func:`gather_small_objects`'s first all-gather. It grows to
the largest object gathered so far (a checkpoint's per-rank entry with its RNG states is about
30 KiB), so that the next call with objects that size takes one all-gather; every rank sees the
same sizes, so every rank grows it alike."""


def small_object_room() -> int:
    """This process's room for one rank's object in :func:`gather_small_objects`."""
    return _small_object_bytes


def widen_small_object_room(size: int) -> None:
    """Make the room at least ``size`` bytes: on every rank of a new process group, the largest any
    of them had (a rank that joined a running job has not grown its own with the others')."""
    global _small_object_bytes
    _small_object_bytes = max(_small_object_bytes, size)


def gather_small_objects(obj: T) -> list[T]:
    """:func:`lockstep.dist.all_gather_object` for bookkeeping that pickles to a few KiB (what each
    rank puts in a checkpoint): one all-gather of a fixed-size buffer over :func:`host_group`, where
    ``all_gather_object`` takes two collectives and a device copy; an object bigger than any
    gathered before (16 KiB at first) costs a second all-gather. Every rank calls it at the same
    point."""
    global _small_object_bytes
    if dist.get_world_size() == 1 or not dist.is_initialized():
        return [obj]
    group, world = host_group(), torch_dist.get_world_size()
    data = pickle.dumps(obj)
    room = _small_object_bytes
    rows = _gather_rows(len(data).to_bytes(8, "little") + data[:room], room + 8, world, group)
    sizes = [int.from_bytes(rows[r][:8], "little") for r in range(world)]
    if max(sizes) <= room:
        return [pickle.loads(rows[r][8:8 + sizes[r]]) for r in range(world)]
    _small_object_bytes = -(-max(sizes) // 4096) * 4096
    rows = _gather_rows(data, max(sizes), world, group)  # every rank read the same sizes: all come here
    return [pickle.loads(rows[r][:sizes[r]]) for r in range(world)]


def _gather_rows(data: bytes, row: int, world: int, group: torch_dist.ProcessGroup | None) -> list[bytes]:
    mine = torch.zeros(row, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = torch.empty(world * row, dtype=torch.uint8)
    wait(torch_dist.all_gather_single(every, mine, group=group, async_op=True))
    flat = every.numpy().tobytes()
    return [flat[r * row:(r + 1) * row] for r in range(world)]


def first_error(error: str | None, *, device: str | torch.device = "cpu") -> tuple[int, str] | None:
    """Agree on success, or on the first failing rank: ``(rank, message)`` on every rank.

    ``error`` is this rank's failure message (None when it succeeded). Every rank must call this
    at the same point, so that a step that fails on one rank is known to all of them instead of
    a rank waiting in the next collective for a peer that gave up. Success costs one one-element
    MAX all-reduce on ``device`` (NCCL reduces only CUDA tensors); the messages are gathered only
    when some rank failed.
    """
    if dist.get_world_size() == 1 or not dist.is_initialized():
        return None if error is None else (dist.get_global_rank(), error)
    flag = torch.tensor([int(error is not None)], dtype=torch.int64, device=device)
    wait(torch_dist.all_reduce(flag, torch_dist.ReduceOp.MAX, async_op=True))
    if not int(flag[0]):
        return None
    return next((rank, m) for rank, m in enumerate(dist.all_gather_object(error)) if m is not None)


def raise_first_error(error: str | None, exception: type[Exception] = RuntimeError, *,
                      device: str | torch.device = "cpu") -> None:
    """:func:`first_error`, raised as ``exception`` on every rank; with several ranks the message
    starts with ``rank N:``."""
    first = first_error(error, device=device)
    if first is not None:
        rank, message = first
        progress.echo(rank)
        raise exception(message if dist.get_world_size() == 1 else f"rank {rank}: {message}")


_IO_KEY = "lockstep/long_io"
"""The job store's count of ranks in :func:`long_io` now."""
_POLL_S = (1e-4, 0.05)
"""How often :func:`wait` looks at its collective: from the first to the second, doubling."""
_ASK_AFTER_S = 0.1
"""How long :func:`wait` waits before it first asks the store whether a rank is in long_io."""


def _store() -> Any:
    """The job's store when a launcher watches this rank's progress in a job of several ranks."""
    if not progress.watched() or dist.get_world_size() == 1 or not dist.is_initialized():
        return None
    return torch_dist.distributed_c10d._get_default_store()


@contextlib.contextmanager
def long_io() -> Iterator[None]:
    """Run this rank's long local work (a checkpoint write) that other ranks may wait for in one
    of these collectives: no rank of the job is called stalled meanwhile, on any node."""
    store = _store()
    with progress.heartbeat_paused():
        if store is None:
            yield
            return
        store.add(_IO_KEY, 1)
        try:
            yield
        finally:
            store.add(_IO_KEY, -1)


def wait(work: Any) -> None:
    """Wait for the async collective ``work``; while some rank of the job is in :func:`long_io`,
    this rank's progress reports are paused (a wait for a peer's write is not a stall), and
    otherwise they are not (a wait for a peer that stopped is the stall to catch). In an elastic
    job a change of its ranks ends the wait (:func:`lockstep.dist.collective_interrupt` raises)."""
    store, interrupt = _store(), dist.collective_interrupt()
    if store is None and interrupt is None:
        work.wait()
        return
    began, delay = time.monotonic(), _POLL_S[0]
    paused: contextlib.ExitStack | None = None
    try:
        while not work.is_completed():
            if interrupt is not None:
                interrupt()
            time.sleep(delay)
            delay = min(2 * delay, _POLL_S[1])
            if store is None or time.monotonic() - began < _ASK_AFTER_S:
                continue
            writing = store.add(_IO_KEY, 0) > 0
            if writing and paused is None:
                paused = contextlib.ExitStack()
                paused.enter_context(progress.heartbeat_paused())
            elif not writing and paused is not None:
                paused.close()
                paused = None
        work.wait()  # raises what failed
    finally:
        if paused is not None:
            paused.close()
