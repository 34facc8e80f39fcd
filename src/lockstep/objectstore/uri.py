"""URIs of objects: ``s3://BUCKET/KEY``. Schemes other than ``s3`` are a one-line error."""

from __future__ import annotations

from urllib.parse import urlparse

from lockstep.objectstore.store import ObjectStore

SUPPORTED = ("s3",)
_KNOWN_OTHERS = ("gs", "oci", "azure", "wasb", "wasbs", "abfs", "abfss", "dbfs", "uc", "hf", "sftp", "http", "https")


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


def check_uri(uri: str, what: str) -> tuple[str, str]:
    """``(bucket, key)`` of an ``s3://`` URI; a one-line ValueError naming ``what`` for any other scheme
    or a URI without a bucket."""
    backend, bucket, key = parse_uri(uri)
    if backend not in SUPPORTED:
        known = " (lockstep supports s3:// only for now)" if backend in _KNOWN_OTHERS else ""
        raise ValueError(f"{what}={uri!r}: {backend}:// object stores are not supported{known}; use an "
                         f"s3://BUCKET/PREFIX URI (S3, MinIO, SeaweedFS, ...) or a local path")
    if not bucket:
        raise ValueError(f"{what}={uri!r} names no bucket: write s3://BUCKET/PREFIX")
    return bucket, key


def store_for_uri(uri: str, what: str = "uri") -> tuple[ObjectStore, str]:
    """An :class:`S3ObjectStore` for the URI's bucket (credentials from the AWS chain, endpoint
    from ``S3_ENDPOINT_URL``), and the URI's key in it."""
    bucket, key = check_uri(uri, what)
    from lockstep.objectstore.s3 import S3ObjectStore

    return S3ObjectStore(bucket), key
