"""Object stores (S3 and S3-compatible servers: MinIO, SeaweedFS, ...), under Composer's names:
:class:`ObjectStore`, :class:`S3ObjectStore`, :func:`parse_uri`. Checkpoints and logger files use
them through URIs such as ``s3://bucket/prefix``."""

from lockstep.objectstore.s3 import S3ObjectStore
from lockstep.objectstore.store import ObjectStore, ObjectStoreTransientError
from lockstep.objectstore.uri import is_uri, parse_uri, store_for_uri

__all__ = ["ObjectStore", "ObjectStoreTransientError", "S3ObjectStore", "is_uri", "parse_uri", "store_for_uri"]
