"""URIs of objects: ``s3://BUCKET/KEY``. Schemes other than ``s3`` are a one-line error, and so
is a URI that is almost one (``s3:/bucket/x``, which would otherwise be a local folder named
``s3:``) or one with a query or fragment (``?versionId=3``, which would otherwise be dropped)."""

from __future__ import annotations

import re
from urllib.parse import urlparse

from lockstep.objectstore.store import ObjectStore

SUPPORTED = ("s3",)
_KNOWN_OTHERS = ("gs", "gcs", "oci", "azure", "az", "wasb", "wasbs", "abfs", "abfss", "dbfs", "uc", "hf", "sftp",
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
                                f"s3:// only for now); use an s3://BUCKET/PREFIX URI (S3, MinIO, SeaweedFS, ...) "
                                f"or a local path")
    raise ValueError(f"{what}={path!r} is not an object store URI (it would be a local path under "
                     f"'{path.split('/', 1)[0]}'): write '{scheme}://{almost['rest']}'")


def check_uri(uri: str, what: str) -> tuple[str, str]:
    """``(bucket, key)`` of an ``s3://`` URI; a one-line ValueError naming ``what`` for any other scheme,
    a URI without a bucket, or one with a query or a fragment."""
    if not is_uri(uri):
        check_path(uri, what)
    backend, bucket, key = parse_uri(uri)
    if backend not in SUPPORTED:
        known = " (lockstep supports s3:// only for now)" if backend in _KNOWN_OTHERS else ""
        raise UnsupportedScheme(f"{what}={uri!r}: {backend}:// object stores are not supported{known}; use an "
                                f"s3://BUCKET/PREFIX URI (S3, MinIO, SeaweedFS, ...) or a local path")
    if not bucket:
        raise ValueError(f"{what}={uri!r} names no bucket: write s3://BUCKET/PREFIX")
    extra = re.search(r"[?#].*$", uri.split("://", 1)[1])
    if extra is not None:
        raise ValueError(f"{what}={uri!r} ends with {extra[0]!r}, which an object store URI cannot hold here (no "
                         f"query, version or fragment): write s3://BUCKET/PREFIX without '?' or '#'")
    return bucket, key


def store_for_uri(uri: str, what: str = "uri") -> tuple[ObjectStore, str]:
    """An :class:`S3ObjectStore` for the URI's bucket (credentials from the AWS chain, endpoint
    from ``S3_ENDPOINT_URL``), and the URI's key in it."""
    bucket, key = check_uri(uri, what)
    from lockstep.objectstore.s3 import S3ObjectStore

    return S3ObjectStore(bucket), key
