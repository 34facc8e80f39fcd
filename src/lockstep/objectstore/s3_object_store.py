"""Composer's ``composer.utils.object_store.s3_object_store`` path: :class:`S3ObjectStore`."""

from lockstep.objectstore.s3 import S3ObjectStore

__all__ = ["S3ObjectStore"]
