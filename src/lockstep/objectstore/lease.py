"""Leases on a bucket's objects: which live job writes under a prefix, across machines that share no
disk and no lock service, only the bucket.

A lease is a small object holding its holder's record (JSON), created with a conditional write
that fails when the object exists (``If-None-Match: *``) and rewritten every :data:`RENEW_S` by
a thread of the holder with a write that fails unless the object is still the holder's last
(``If-Match: <its ETag>``). A lease that has not been rewritten for :data:`LAPSE_S` has lapsed: its
holder is dead or cut off, and the next claimer takes it over (conditionally too, so of two
claimers one wins). Its age is the server's clock minus the object's Last-Modified, both the
server's, so no two machines' clocks are ever compared. A claimer that finds a lease watches it
until it is rewritten (its holder is alive: refused) or lapses (taken over): a job killed with
``kill -9`` keeps its own autoresume waiting at most :data:`LAPSE_S` after its last renewal.

A server that ignores the conditions, or refuses them as not implemented (an old S3-compatible
server), gets the same protocol without them: a window of a request's length in which two
claimers could both win, and no holder told that its lease was taken over.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from lockstep.objectstore.s3 import S3ObjectStore

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
_TAKEN = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
_UNSUPPORTED = ("NotImplemented", "501")
"""What a server that does not take conditional writes answers to one."""


class Lease:
    """A lease on the object ``key`` of ``store``, held with ``record`` (what a refused claimer is
    told: run name, host, pid). ``on_lost`` is called once, from the renewing thread, with the new
    holder's record when another claimer took the lease over (this holder had not renewed it for
    :data:`LAPSE_S`, or its object was deleted). ``holder`` tells this holder's writes from any
    other's (default: a new random id); writers guarded by it (:mod:`lockstep.objectstore.writer`)
    stop once another holder's record is there."""

    def __init__(self, store: S3ObjectStore, key: str, record: dict[str, Any], *,
                 on_lost: Callable[[dict[str, Any]], None] | None = None, holder: str | None = None) -> None:
        self.store, self.key = store, key
        self.record = {**record, "holder": holder or uuid.uuid4().hex}
        """What the lease object holds."""
        self.on_lost = on_lost
        self._etag: str | None = None
        self._renewals = 0
        self._conditional = True
        """False once the server refused a conditional write as not implemented."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._etag is not None

    def acquire(self, *, deadline_s: float = LAPSE_S + 4 * _POLL_S + 2.0) -> dict[str, Any] | None:
        """Take the lease and start renewing it; None once held. Another holder's lease is watched
        until it lapses (then taken over) or is renewed (then its record is returned: that holder
        is alive). ``deadline_s`` bounds the watch (a lease renewed too slowly to tell)."""
        started = time.monotonic()
        seen: str | None = None
        while True:
            found = self._head()
            if found is None:
                if self._put(condition={"IfNoneMatch": "*"}):
                    self._start_renewing()
                    return None
                if time.monotonic() - started > deadline_s:
                    return {}
                time.sleep(_POLL_S)  # another claimer created it between the two requests
                continue
            etag, age, record = found
            if age >= LAPSE_S and self._put(condition={"IfMatch": etag}):
                self._start_renewing()
                return None
            if (seen is not None and etag != seen) or time.monotonic() - started > deadline_s:
                return record  # renewed while watched: its holder is alive
            seen = etag
            time.sleep(_POLL_S)

    def release(self) -> None:
        """Stop renewing and delete the lease, unless another holder has taken it over. A renewal
        under way is waited for: the store's client should have short timeouts (see :func:`client_for_leases`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_RELEASE_WAIT_S)
            if self._thread.is_alive():  # a renewal stuck on the network: the lease lapses by itself
                self._etag = None
                return
            self._thread = None
        etag, self._etag = self._etag, None
        if etag is None:
            return
        try:
            found = self._head()
            if found is not None and found[0] == etag:
                self.store.client.delete_object(Bucket=self.store.bucket, Key=self.store.get_key(self.key))
        except Exception:  # unreachable now: the lease lapses by itself
            pass

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="lockstep-bucket-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        pause = RENEW_S
        while not self._stop.wait(pause):
            etag, pause = self._etag, RENEW_S
            if etag is None:
                return
            try:
                if self._put(condition={"IfMatch": etag}):
                    continue
                found = self._head()
            except Exception:  # the server unreachable for now: try again soon; past LAPSE_S it may be taken
                pause = _RETRY_S
                continue
            if found is not None and found[2].get("holder") == self.record["holder"]:
                self._etag = found[0]  # our own write, whose reply was lost to a retry (or a conflict)
                continue
            if self._stop.is_set():
                return
            self._etag = None  # taken over (or deleted) by another claimer
            if self.on_lost is not None:
                self.on_lost(found[2] if found is not None else {})
            return

    def _put(self, *, condition: dict[str, str]) -> bool:
        """Write this holder's record under ``condition``; False when the condition failed."""
        import botocore.exceptions

        self._renewals += 1
        body = json.dumps({**self.record, "renewal": self._renewals}).encode()
        try:
            reply = self.store.client.put_object(Bucket=self.store.bucket, Key=self.store.get_key(self.key),
                                                 Body=body, ContentType="application/json",
                                                 **(condition if self._conditional else {}))
        except botocore.exceptions.ParamValidationError:  # a boto3 older than 1.35.69, below lockstep[s3]
            if not self._conditional:
                raise
            self._conditional = False
            return self._put(condition=condition)
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _TAKEN or status in _TAKEN:
                return False
            if code in ("NoSuchKey", "404") and "IfMatch" in condition:
                return False  # deleted meanwhile
            if (code in _UNSUPPORTED or status in _UNSUPPORTED) and self._conditional:
                self._conditional = False
                return self._put(condition=condition)
            raise
        self._etag = reply.get("ETag")
        return True

    def _head(self) -> tuple[str, float, dict[str, Any]] | None:
        """(ETag, age in seconds by the server's clock, holder's record) of the lease; None when
        there is none."""
        import botocore.exceptions

        try:
            reply = self.store.client.get_object(Bucket=self.store.bucket, Key=self.store.get_key(self.key))
        except botocore.exceptions.ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        body = reply["Body"].read()
        date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        # without the server's Date (a proxy dropped it), this machine's clock stands in for it
        now = email.utils.parsedate_to_datetime(date) if date else datetime.datetime.now(datetime.timezone.utc)
        try:
            record = json.loads(body or b"{}")
        except ValueError:
            record = {}
        return reply["ETag"], (now - reply["LastModified"]).total_seconds(), record


def client_for_leases(store: S3ObjectStore) -> S3ObjectStore:
    """A store of the same bucket and endpoint whose requests give up within seconds: a lease's
    renewals and release must never hold a job up for long (a partition, a server gone)."""
    return S3ObjectStore(store.bucket, store.prefix, endpoint_url=store.endpoint_url,
                         client_config={"connect_timeout": 2, "read_timeout": 5,
                                        "retries": {"mode": "standard", "total_max_attempts": 2}})


def lease_records(store: S3ObjectStore, prefix: str) -> list[tuple[str, str, float, dict[str, Any]]]:
    """(key, ETag, age in seconds by the server's clock, record) of each lease under ``prefix``
    (keys starting with it, relative to the store's prefix)."""
    found = []
    for full in store.list_objects(prefix):
        name = full[len(store.prefix):] if full.startswith(store.prefix) else full
        head = Lease(store, name, {})._head()
        if head is not None:
            found.append((name, *head))
    return found


def supersede(store: S3ObjectStore, key: str, etag: str, record: dict[str, Any]) -> bool:
    """Write ``record`` (under a holder id of its own) over the lapsed lease ``key`` whose ETag is
    ``etag``, renewed by nobody: its holder, should it come back, finds its lease lost at its next
    renewal, and writers it guards stop. False when the holder renewed it meanwhile (it is alive)."""
    return Lease(store, key, record)._put(condition={"IfMatch": etag})
