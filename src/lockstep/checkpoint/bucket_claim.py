"""Who writes into a save folder in a bucket: the bucket's counterpart of :mod:`ownership`, for jobs
on machines that share no disk.

Rank 0 of a run holds a lease (:mod:`lockstep.objectstore.lease`) on the object
``<save_folder>/.lockstep-lease.<run>``, recording the run, its host and pid and the glob
patterns of its checkpoint names, for as long as it trains. A claim is refused when

- the same run's lease is alive (renewed while the claimer watched it): a second job of the run
  writing the same folder, from this machine or another; or
- another run's live lease holds patterns that can name the same objects (such a lease that has
  lapsed is superseded by a record naming this run, which its holder, if only cut off, meets at
  its next renewal: it has lost the folder).

Claimers of a folder take turns (a short lease of its own, :data:`CLAIMING`) to look at its
leases and take theirs, so that two runs that start at once cannot each miss the other.
A lease that lapses (its job was killed, or lost the bucket for :data:`~lockstep.objectstore.lease.LAPSE_S`)
is taken over, so a killed job's autoresume waits at most that long. A holder whose lease was taken
over fails at its next save, since two jobs would overwrite each other's checkpoints; before that,
its ranks' uploads, pointer moves and deletions are guarded by the lease (:func:`guard`), so that
none of them lands once another job's record is there.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from lockstep.checkpoint import ownership
from lockstep.checkpoint.remote import LEASE_PREFIX, RemoteFolder, error_line
from lockstep.objectstore.lease import LAPSE_S, Lease, client_for_leases, lease_records, supersede
from lockstep.objectstore.writer import Guard

_held: dict[tuple[str, str], tuple[Lease, list[Callable[[str], None]]]] = {}
"""This process's leases: (bucket, key) -> the lease and its holders' ``on_lost``. Claims of one
process share a lease (a notebook that builds a new Trainer before dropping the old one)."""
CLAIMING = LEASE_PREFIX + "~claiming"
"""The lease a claimer holds while it looks at the folder's leases and takes its own (no run's
lease has this name: :func:`~lockstep.checkpoint.ownership.safe_name` never keeps a ``~``)."""
_TURN_WAIT_S = 60.0
"""How long one claimer may hold the turn before a waiting claimer gives up (a claim holds it for a
few requests, or up to about 10 s while it watches a lease that may have lapsed)."""
_HOLDER = uuid.uuid4().hex
"""This process's holder id in every lease it takes: the same across its claims of one folder, so
that writes queued under an earlier claim stay allowed under the next."""


def _new_holder() -> None:
    global _HOLDER
    _HOLDER = uuid.uuid4().hex


os.register_at_fork(after_in_child=_new_holder)  # a forked process is another holder


def claim(folder: RemoteFolder, run_name: str, patterns: list[str], on_lost: Callable[[str], None]) -> str | None:
    """Claim ``folder`` for ``run_name``, which writes names matching ``patterns`` (globs relative to
    the folder). Returns why it may not (one line), or None once claimed; ``on_lost`` gets a line
    saying so if another job takes the lease over later."""
    key = _lease_key(folder, run_name)
    place = (folder.store.bucket, key)
    if place in _held and _held[place][0].held:
        _held[place][1].append(on_lost)
        return None
    here = (os.getpid(), socket.gethostname())
    try:
        store = client_for_leases(folder.store)
        # the look at other runs' leases and the taking of this one are one step for every claimer
        # of the folder, as the local claim's flock makes them: two runs starting at once cannot both
        # find the folder free of the other
        turn = Lease(store, folder.key_of(CLAIMING), {"host": here[1], "pid": here[0], "claiming": run_name})
        if not _wait_for_turn(turn):
            return (f"cannot claim save_folder {folder.uri} for run {run_name!r}: another job has been claiming it "
                    f"for over {_TURN_WAIT_S:.0f} s; try again")
        try:
            why = _clash(folder, store, run_name, patterns, here)
            if why is not None:
                return why
            record = {"run_name": run_name, "host": here[1], "pid": here[0], "since": time.time(), "patterns": patterns}
            callbacks = [on_lost]
            lease = Lease(store, key, record, on_lost=lambda holder: _lost(folder, run_name, holder, callbacks),
                          holder=_HOLDER)
            holder = lease.acquire()
        finally:
            turn.release()
    except Exception as e:
        return f"cannot claim save_folder {folder.uri} for run {run_name!r}: {error_line(e)}"
    if holder is not None and holder.get("run_name", run_name) != run_name:  # names alike once made safe
        return (f"save_folder {folder.uri} is in use by run {holder['run_name']!r} ({ownership.who(holder)}), whose "
                f"lease there has the name this run's would have ({LEASE_PREFIX}{ownership.safe_name(run_name)}): "
                f"give this run a name that differs in a letter or digit")
    if holder is not None:
        return (f"run {run_name!r} is already running with save_folder {folder.uri} ({ownership.who(holder)}, which "
                f"renews its lease there): stop that job first, or give this one another run_name or "
                f"save_folder")
    _held[place] = (lease, callbacks)
    return None


def _wait_for_turn(turn: Lease) -> bool:
    """Take the folder's claiming lease once no other claimer holds it (one that died lapses).
    Waits as long as the turn passes from claimer to claimer; False once one claimer has held it
    for :data:`_TURN_WAIT_S`."""
    holder, since = None, time.monotonic()
    while (record := turn.acquire()) is not None:
        if record.get("holder") != holder:
            holder, since = record.get("holder"), time.monotonic()
        elif time.monotonic() - since > _TURN_WAIT_S:
            return False
        time.sleep(0.2)
    return True


def _clash(folder: RemoteFolder, store: Any, run_name: str, patterns: list[str],
           here: tuple[int, str]) -> str | None:
    """Why another run's live lease in ``folder`` refuses this claim (names that can clash). Such a
    lease that has lapsed is superseded, so that its holder, cut off for a while rather than dead,
    learns at its next renewal that the folder is no longer its own."""
    for key, etag, age, record in lease_records(store, folder.key_of(LEASE_PREFIX)):
        if "patterns" not in record or record.get("run_name") == run_name or \
                (record.get("pid"), record.get("host")) == here:
            continue  # a claimer's turn; the same run is the lease's own business; one process never clashes
        same = ownership.clash(patterns, list(record["patterns"]))
        if same is None:
            continue
        took_over = {"run_name": run_name, "host": here[1], "pid": here[0], "since": time.time(),
                     "superseded": record.get("run_name")}
        if age >= LAPSE_S and supersede(store, key, etag, took_over):
            continue
        return (f"save_folder {folder.uri} is in use by run {record.get('run_name')!r} "
                f"({ownership.who(record)}), which writes checkpoints named like this run's ({same}): use "
                f"save_folder='{folder.uri}/{{run_name}}', or put {{run_name}} in save_filename and "
                f"save_latest_filename")
    return None


def guard(folder: RemoteFolder, run_name: str) -> Guard:
    """What a claim by this process lets write into ``folder`` for ``run_name``: the lease's key
    and this process's holder id (for every rank's :class:`~lockstep.checkpoint.remote.Uploader`)."""
    return _lease_key(folder, run_name), _HOLDER


def _lease_key(folder: RemoteFolder, run_name: str) -> str:
    """The key of ``run_name``'s lease in ``folder``."""
    return folder.key_of(LEASE_PREFIX + ownership.safe_name(run_name))


def release(folder: RemoteFolder, run_name: str, on_lost: Callable[[str], None]) -> None:
    """Give up a claim made by :func:`claim` (the lease goes once every claim of this process has)."""
    place = (folder.store.bucket, _lease_key(folder, run_name))
    held = _held.get(place)
    if held is None or on_lost not in held[1]:
        return
    held[1].remove(on_lost)
    if not held[1]:
        del _held[place]
        held[0].release()


def _lost(folder: RemoteFolder, run_name: str, holder: dict[str, Any], callbacks: list[Callable[[str], None]]) -> None:
    place = (folder.store.bucket, _lease_key(folder, run_name))
    if place in _held and _held[place][1] is callbacks:
        del _held[place]  # a later claim in this process must acquire the lease again
    other = holder.get("run_name", run_name)
    job = f"another job of run {run_name!r}" if other == run_name else f"run {other!r}"
    message = (f"{job} ({ownership.who(holder)}) took save_folder {folder.uri} over, "
               f"after this job had not renewed its lease there for a while (the bucket unreachable, or the job "
               f"stalled): stopping, so that the two do not overwrite each other's checkpoints")
    for callback in list(callbacks):
        callback(message)
