"""Composer's ``composer.utils.object_store.object_store`` path: :class:`ObjectStore` and its transient error."""

from lockstep.objectstore.store import ObjectStore, ObjectStoreTransientError

__all__ = ["ObjectStore", "ObjectStoreTransientError"]
