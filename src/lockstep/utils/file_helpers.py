"""Composer's ``composer.utils.file_helpers`` names: :func:`is_tar` and :func:`get_file` (a local
path or an object-store URI, copied to a destination), and the name formatters."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

from lockstep.objectstore.uri import is_uri, store_for_uri
from lockstep.utils.names import format_name_with_dist, format_name_with_dist_and_time

__all__ = ["format_name_with_dist", "format_name_with_dist_and_time", "get_file", "is_tar"]


def is_tar(name: str | pathlib.Path) -> bool:
    """Whether ``name`` ends like a tarball: ``.tar``, ``.tar.gz`` (any ``.tar.*``), ``.tgz``."""
    parts = str(name).split(".")
    return len(parts) > 1 and ("tar" in parts[-2:] or parts[-1] == "tgz")


def get_file(path: str, destination: str | pathlib.Path, object_store: Any = None, overwrite: bool = False,
             progress_bar: bool = True) -> None:
    """Copy ``path`` to ``destination``: from ``object_store`` when given (``path`` is then a name in
    it), from a bucket when ``path`` is a URI such as ``s3://b/k``, else from the local disk. An
    existing destination is an error unless ``overwrite``."""
    destination = pathlib.Path(destination)
    if destination.exists() and not overwrite:
        raise FileExistsError(f"get_file: {destination} exists; pass overwrite=True to replace it")
    destination.parent.mkdir(parents=True, exist_ok=True)
    if object_store is not None or is_uri(path):
        store, key = (object_store, path) if object_store is not None else store_for_uri(path, "path")
        store.download_object(key, destination, overwrite=overwrite)
        return
    if not pathlib.Path(path).exists():
        raise FileNotFoundError(f"get_file: {path} does not exist")
    shutil.copyfile(path, destination)
