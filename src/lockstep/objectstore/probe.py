"""Before training: can this process reach the bucket, with these credentials, and write there?
Each failure is one line naming the bucket and what to change (each backend's ``problem``)."""

from __future__ import annotations

import uuid

from lockstep.objectstore.store import ObjectStore, ObjectStoreTransientError


def problem(store: ObjectStore, key: str, *, write: bool) -> str | None:
    """What keeps ``store`` from serving (and, with ``write``, taking) objects under ``key``; None
    when it works. A store of lockstep's backends checks itself; any other object store (one
    given as ``load_object_store``) is asked to list the key."""
    check = getattr(store, "problem", None)
    if callable(check):
        return check(key, write=write)
    try:
        store.list_objects(key)
    except Exception as e:
        return f"object store {store!r} cannot list {key!r}: {first_line(e)}"
    return None


def try_a_write(store: ObjectStore, key: str) -> None:
    """Put a small object under ``key`` and delete it: a write is tried for real, since read
    permissions say nothing of write ones. Raises the client's own error, as the listing before
    it does, which each backend's explanation knows: a store method raises its client's timeout or
    refused connection inside an :class:`ObjectStoreTransientError`, unwrapped here."""
    name = f".lockstep-probe-{uuid.uuid4().hex}"
    name = f"{key.rstrip('/')}/{name}" if key else name
    try:
        store.upload_bytes(name, b"")  # type: ignore[attr-defined]
        store.delete_object(name)  # type: ignore[attr-defined]
    except ObjectStoreTransientError as e:
        if isinstance(e.__cause__, Exception):
            raise e.__cause__ from None
        raise


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
