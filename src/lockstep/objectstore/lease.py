"""Leases on a bucket's objects: which live job writes under a prefix, across machines that share no
disk and no lock service, only the bucket.

A lease is a small object holding its holder's record (JSON), created with a conditional write
that fails when the object exists and rewritten every :data:`RENEW_S` by a thread of the holder
with a write that fails unless the object is still the holder's last version (S3's and Azure's
``If-None-Match: *`` and ``If-Match: <ETag>``, GCS's ``ifGenerationMatch``: the store's
``put_if``, :class:`~lockstep.objectstore.store.BucketStore`). A lease that has not been
rewritten for :data:`LAPSE_S` has lapsed: its holder is dead or cut off, and the next claimer
takes it over (conditionally too, so of two claimers one wins). Its age is the server's clock
minus the object's last write, both the server's, so no two machines' clocks are ever compared.
A claimer that finds a lease watches it until it is rewritten (its holder is alive: refused) or
lapses (taken over): a job killed with ``kill -9`` keeps its own autoresume waiting at most
:data:`LAPSE_S` after its last renewal.

A server that ignores the conditions, or refuses them as not implemented (an old S3-compatible
server), gets the same protocol without them: a window of a request's length in which two
claimers could both win, and no holder told that its lease was taken over.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from lockstep.objectstore.store import BucketStore

LAPSE_S = 5.0
"""Seconds without a renewal after which a lease has lapsed (the server's clock, whole seconds)."""
RENEW_S = 1.0
"""Seconds between a holder's renewals: several fit in :data:`LAPSE_S` (whose whole seconds may
be one short), with room for a slow request."""
_RETRY_S = 0.3
"""Seconds before a renewal that failed (the server out of reach) is tried again."""
_POLL_S = 0.5
_RELEASE_WAIT_S = 8.0
"""How long a release waits for a renewal under way; past it the lease is left to lapse."""


class Lease:
    """A lease on the object ``key`` of ``store``, held with ``record`` (what a refused claimer is
    told: run name, host, pid). ``on_lost`` is called once, from the renewing thread, with the new
    holder's record when another claimer took the lease over (this holder had not renewed it for
    :data:`LAPSE_S`, or its object was deleted). ``holder`` tells this holder's writes from any
    other's (default: a new random id); writers guarded by it (:mod:`lockstep.objectstore.writer`)
    stop once another holder's record is there."""

    def __init__(self, store: BucketStore, key: str, record: dict[str, Any], *,
                 on_lost: Callable[[dict[str, Any]], None] | None = None, holder: str | None = None) -> None:
        self.store, self.key = store, key
        self.record = {**record, "holder": holder or uuid.uuid4().hex}
        """What the lease object holds."""
        self.on_lost = on_lost
        self._token: str | None = None
        self._renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._token is not None

    def acquire(self, *, deadline_s: float = LAPSE_S + 4 * _POLL_S + 2.0) -> dict[str, Any] | None:
        """Take the lease and start renewing it; None once held. Another holder's lease is watched
        until it lapses (then taken over) or is renewed (then its record is returned: that holder
        is alive). ``deadline_s`` bounds the watch (a lease renewed too slowly to tell)."""
        started = time.monotonic()
        seen: str | None = None
        changes = 0
        while True:
            found = self._head()
            if found is None:
                if self._put(token=None):
                    self._start_renewing()
                    return None
                if time.monotonic() - started > deadline_s:
                    return {}
                time.sleep(_POLL_S)  # another claimer created it between the two requests
                continue
            token, age, record = found
            if age >= LAPSE_S and self._put(token=token):
                self._start_renewing()
                return None
            # Renewed twice while watched: its holder is alive. One change alone may be a renewal a
            # holder killed just now had sent, which a busy server wrote after the first look.
            changes += seen is not None and token != seen
            if changes >= 2 or time.monotonic() - started > deadline_s:
                return record
            seen = token
            time.sleep(_POLL_S)

    def release(self) -> None:
        """Stop renewing and delete the lease, unless another holder has taken it over. A renewal
        under way is waited for: the store's client should have short timeouts (see :func:`client_for_leases`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_RELEASE_WAIT_S)
            if self._thread.is_alive():  # a renewal stuck on the network: the lease lapses by itself
                self._token = None
                return
            self._thread = None
        token, self._token = self._token, None
        if token is None:
            return
        try:
            found = self._head()
            if found is not None and found[0] == token:
                self.store.delete_object(self.key)
        except Exception:  # unreachable now: the lease lapses by itself
            pass

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="lockstep-bucket-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        pause = RENEW_S
        while not self._stop.wait(pause):
            token, pause = self._token, RENEW_S
            if token is None:
                return
            try:
                if self._put(token=token):
                    continue
                found = self._head()
            except Exception:  # the server unreachable for now: try again soon; past LAPSE_S it may be taken
                pause = _RETRY_S
                continue
            if found is not None and found[2].get("holder") == self.record["holder"]:
                self._token = found[0]  # our own write, whose reply was lost to a retry (or a conflict)
                continue
            if self._stop.is_set():
                return
            self._token = None  # taken over (or deleted) by another claimer
            if self.on_lost is not None:
                self.on_lost(found[2] if found is not None else {})
            return

    def _put(self, *, token: str | None) -> bool:
        """Write this holder's record if the lease is absent (``token=None``) or still the version
        ``token`` names; False when that condition failed."""
        self._renewals += 1
        body = json.dumps({**self.record, "renewal": self._renewals}).encode()
        written = self.store.put_if(self.key, body, token=token)
        if written is None:
            return False
        self._token = written
        return True

    def _head(self) -> tuple[str, float, dict[str, Any]] | None:
        """(version token, age in seconds by the server's clock, holder's record) of the lease;
        None when there is none."""
        found = self.store.read_versioned(self.key)
        if found is None:
            return None
        try:
            record = json.loads(found.data or b"{}")
        except ValueError:
            record = {}
        return found.token, found.age_s, record if isinstance(record, dict) else {}


def client_for_leases(store: BucketStore) -> BucketStore:
    """A store of the same bucket whose requests give up within seconds: a lease's renewals and
    release must never hold a job up for long (a partition, a server gone)."""
    return store.quick()


def lease_records(store: BucketStore, prefix: str) -> list[tuple[str, str, float, dict[str, Any]]]:
    """(key, version token, age in seconds by the server's clock, record) of each lease under ``prefix``
    (keys starting with it, relative to the store's prefix)."""
    found = []
    for full in store.list_objects(prefix):
        name = full[len(store.prefix):] if full.startswith(store.prefix) else full
        head = Lease(store, name, {})._head()
        if head is not None:
            found.append((name, *head))
    return found


def supersede(store: BucketStore, key: str, token: str, record: dict[str, Any]) -> bool:
    """Write ``record`` (under a holder id of its own) over the lapsed lease ``key`` whose version token is
    ``token``, renewed by nobody: its holder, should it come back, finds its lease lost at its next
    renewal, and writers it guards stop. False when the holder renewed it meanwhile (it is alive)."""
    return Lease(store, key, record)._put(token=token)
