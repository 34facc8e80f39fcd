"""URIs of objects (``s3://BUCKET/KEY``, ``gs://BUCKET/KEY``, ``azure://CONTAINER/KEY``) and the one
factory of their stores, :func:`store_for_uri`. Other schemes are a one-line error, and so is a
URI that is almost one (``s3:/bucket/x``, which would otherwise be a local folder named ``s3:``)
or one with a query or fragment (``?versionId=3``, which would otherwise be dropped).

A new backend is a module with a class of the :class:`~lockstep.objectstore.store.BucketStore`
protocol and one line in :data:`BACKENDS`."""

from __future__ import annotations

import importlib
import re
from typing import Any
from urllib.parse import urlparse

from lockstep.objectstore.store import BucketStore

BACKENDS = {
    "s3": ("lockstep.objectstore.s3", "S3ObjectStore"),
    "gs": ("lockstep.objectstore.gcs", "GCSObjectStore"),
    "azure": ("lockstep.objectstore.azure", "AzureObjectStore"),
    "az": ("lockstep.objectstore.azure", "AzureObjectStore"),
}
"""Each URI scheme's store: module and class, imported on first use (each needs its extra)."""
SUPPORTED = tuple(BACKENDS)
_NAMES = "s3://, gs:// or azure://"
_KNOWN_OTHERS = ("gcs", "oci", "wasb", "wasbs", "abfs", "abfss", "dbfs", "uc", "hf", "sftp",
                 "http", "https", "wandb", "r2")
_ALMOST = re.compile(rf"^(?P<scheme>{'|'.join(SUPPORTED + _KNOWN_OTHERS)}):/(?!/)(?P<rest>.*)$", re.IGNORECASE)
"""A known scheme, then ``:/`` without the second slash: taken as a local path, ``s3:/b/x`` is a folder ``s3:``."""


class UnsupportedScheme(ValueError, NotImplementedError):
    """A URI whose scheme lockstep has no store for: a ValueError, and the NotImplementedError Composer raises."""


def is_uri(path: object) -> bool:
    """Whether ``path`` names an object in a store (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path and bool(urlparse(path).scheme)


def parse_uri(uri: str) -> tuple[str, str, str]:
    """``(backend, bucket, path)``, as Composer's ``parse_uri``: ``('s3', 'b', 'x/y')`` for
    ``s3://b/x/y``, and ``('', '', uri)`` for a local path."""
    if not is_uri(uri):
        return "", "", uri
    parsed = urlparse(uri)
    return parsed.scheme, parsed.netloc, parsed.path.lstrip("/")


def check_path(path: object, what: str, *, any_scheme: bool = False) -> None:
    """A one-line ValueError naming ``what`` when ``path`` (a save_folder, load_path, ...) starts with
    a known scheme but is not a URI (``s3:/bucket/x``: one slash), or is a URI that :func:`check_uri`
    refuses (with ``any_scheme``, a URI for an object store the caller gave is not checked); nothing
    for a local path."""
    if not isinstance(path, str):
        return
    if is_uri(path):
        if not any_scheme:
            check_uri(path, what)
        return
    almost = _ALMOST.match(path)
    if almost is None:
        return
    scheme = almost["scheme"].lower()
    if scheme == "dbfs":  # Databricks writes its URIs with one slash: dbfs:/Volumes/...
        raise UnsupportedScheme(f"{what}={path!r}: dbfs: object stores are not supported (lockstep supports "
                                f"{_NAMES}); use one of those URIs or a local path")
    raise ValueError(f"{what}={path!r} is not an object store URI (it would be a local path under "
                     f"'{path.split('/', 1)[0]}'): write '{scheme}://{almost['rest']}'")


def check_uri(uri: str, what: str) -> tuple[str, str]:
    """``(bucket, key)`` of a URI of a supported scheme; a one-line ValueError naming ``what`` for any
    other scheme, a URI without a bucket, or one with a query or a fragment."""
    if not is_uri(uri):
        check_path(uri, what)
    backend, bucket, key = parse_uri(uri)
    if backend not in SUPPORTED:
        hint = " (write gs:// for Google Cloud Storage)" if backend == "gcs" else ""
        raise UnsupportedScheme(f"{what}={uri!r}: {backend}:// object stores are not supported{hint}; use an "
                                f"{_NAMES} URI (S3 or an S3-compatible server, Google Cloud Storage, Azure Blob "
                                f"Storage) or a local path")
    if not bucket:
        raise ValueError(f"{what}={uri!r} names no bucket: write {backend}://BUCKET/PREFIX")
    extra = re.search(r"[?#].*$", uri.split("://", 1)[1])
    if extra is not None:
        raise ValueError(f"{what}={uri!r} ends with {extra[0]!r}, which an object store URI cannot hold here (no "
                         f"query, version or fragment): write {backend}://BUCKET/PREFIX without '?' or '#'")
    return bucket, key


def store_for_uri(uri: str, what: str = "uri") -> tuple[BucketStore, str]:
    """The store of the URI's bucket (credentials and endpoint from the environment, as each
    backend's module says) and the URI's key in it."""
    bucket, key = check_uri(uri, what)
    return store_of(urlparse(uri).scheme.lower(), bucket), key


def store_of(scheme: str, bucket: str, **options: Any) -> BucketStore:
    """The store of ``bucket`` for URI ``scheme``, with its class's keyword ``options``."""
    module, name = BACKENDS[scheme]
    return getattr(importlib.import_module(module), name)(bucket, **options)
