"""Object stores under Composer's names: :class:`ObjectStore`, :class:`S3ObjectStore` (S3 and
S3-compatible servers: MinIO, SeaweedFS, ...), :class:`GCSObjectStore`, :class:`AzureObjectStore`,
:func:`parse_uri`. Checkpoints and logger files use them through URIs such as ``s3://bucket/prefix``,
``gs://bucket/prefix`` or ``azure://container/prefix`` (:func:`store_for_uri`); each backend's
client installs with its extra (``torch-lockstep[s3]``, ``[gcs]``, ``[azure]``)."""

from lockstep.objectstore.azure import AzureObjectStore
from lockstep.objectstore.gcs import GCSObjectStore
from lockstep.objectstore.s3 import S3ObjectStore
from lockstep.objectstore.store import BucketStore, ObjectStore, ObjectStoreTransientError, Versioned
from lockstep.objectstore.uri import is_uri, parse_uri, store_for_uri

__all__ = ["AzureObjectStore", "BucketStore", "GCSObjectStore", "ObjectStore", "ObjectStoreTransientError",
           "S3ObjectStore", "Versioned", "is_uri", "parse_uri", "store_for_uri"]
