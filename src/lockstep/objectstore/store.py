"""What an object store does, as Composer's ``ObjectStore`` names it: a protocol, so that any
object with these methods (Composer's own stores too) can be passed as ``load_object_store``."""

from __future__ import annotations

import contextlib
import os
import pathlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class ObjectStoreTransientError(RuntimeError):
    """A failure that may go away if tried again (a dropped connection, a throttled request)."""


@runtime_checkable
class ObjectStore(Protocol):
    """Upload, download and list objects by name. Names are relative to the store's prefix;
    :meth:`get_uri` gives an object's full URI."""

    def get_uri(self, object_name: str) -> str:
        """The URI of ``object_name`` (computed; the object need not exist)."""
        ...

    def upload_object(self, object_name: str, filename: str | pathlib.Path,
                      callback: Callable[[int, int], None] | None = None) -> None:
        """Upload the file ``filename`` as ``object_name``, replacing any object of that name;
        ``callback(bytes_done, total)`` is told of the progress."""
        ...

    def download_object(self, object_name: str, filename: str | pathlib.Path, overwrite: bool = False,
                        callback: Callable[[int, int], None] | None = None) -> None:
        """Download ``object_name`` to ``filename`` (whole or not at all). FileNotFoundError when
        there is no such object; FileExistsError when ``filename`` exists and not ``overwrite``."""
        ...

    def get_object_size(self, object_name: str) -> int:
        """The object's size in bytes; FileNotFoundError when there is no such object."""
        ...

    def list_objects(self, prefix: str | None = None) -> list[str]:
        """The keys of the objects whose name starts with ``prefix`` (as Composer: the store's
        prefix included)."""
        ...


@dataclass(frozen=True)
class Versioned:
    """A small object read together with what a conditional write needs: the server's token for
    this version of it (an S3 or Azure ETag, a GCS generation) and its age in seconds by the
    server's own clock (the server's time of the reply minus the object's last write)."""

    data: bytes
    token: str
    age_s: float


@runtime_checkable
class BucketStore(ObjectStore, Protocol):
    """An :class:`ObjectStore` of one bucket (an S3 bucket, a GCS bucket, an Azure container),
    with what lockstep's checkpoints need beyond Composer's methods: small objects, deletions,
    conditional writes (for leases), a check that the bucket serves this process, and the
    arguments that make the same store in another process. Every store of
    :func:`lockstep.objectstore.store_for_uri` is one."""

    scheme: str
    """The URI scheme of its objects (``s3``, ``gs``, ``azure``)."""
    bucket: str
    prefix: str

    def get_key(self, object_name: str) -> str:
        """The object's key in the bucket (the store's prefix and ``object_name``)."""
        ...

    def upload_bytes(self, object_name: str, data: bytes) -> None:
        """Put a small object in one request, replacing any object of that name."""
        ...

    def read_bytes(self, object_name: str) -> bytes:
        """A small object's content; FileNotFoundError when there is none."""
        ...

    def delete_object(self, object_name: str) -> None:
        """Delete ``object_name``; nothing happens when there is none."""
        ...

    def read_versioned(self, object_name: str) -> Versioned | None:
        """The object with its version token and age; None when there is none."""
        ...

    def put_if(self, object_name: str, data: bytes, *, token: str | None) -> str | None:
        """Write ``data`` only if the object does not exist (``token=None``) or is still the
        version ``token`` names; the new version's token, or None when the condition failed (or,
        replacing, when the object is gone)."""
        ...

    def problem(self, object_name: str, *, write: bool) -> str | None:
        """Why this process cannot list (and, with ``write``, write) objects under
        ``object_name``, in one line naming the bucket and what to change; None when it can."""
        ...

    def quick(self) -> BucketStore:
        """The same store with requests that give up within seconds (for leases, which must never
        hold a job up for long)."""
        ...

    def options(self) -> dict[str, Any]:
        """Keyword arguments that make this store again in another process (with ``bucket`` and
        the class of :data:`lockstep.objectstore.uri.BACKENDS` for :attr:`scheme`); no secret
        that the environment gives the other process too."""
        ...

    def close(self) -> None:
        ...


@contextlib.contextmanager
def whole_file(filename: str | pathlib.Path, overwrite: bool,
               translated: Callable[[Exception], Exception]) -> Iterator[str]:
    """A download's target, whole or not at all: yields a temporary name beside ``filename`` (its
    folder made), renamed to ``filename`` once the body succeeded and removed if it did not.
    FileExistsError when ``filename`` exists and not ``overwrite``. The client's errors (not the
    file system's) are raised as ``translated(error)`` makes them."""
    filename = str(filename)
    if os.path.exists(filename) and not overwrite:
        raise FileExistsError(f"{filename} already exists: pass overwrite=True to replace it")
    if os.path.dirname(filename):
        os.makedirs(os.path.dirname(filename), exist_ok=True)
    temp = f"{filename}.{uuid.uuid4().hex}.tmp"
    try:
        yield temp
        os.replace(temp, filename)
    except BaseException as e:
        try:
            os.remove(temp)
        except OSError:
            pass
        if isinstance(e, Exception) and not isinstance(e, OSError):
            raise translated(e) from e
        raise
