"""What an object store does, as Composer's ``ObjectStore`` names it: a protocol, so that any
object with these methods (Composer's own stores too) can be passed as ``load_object_store``."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable


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
