"""Composer's ``composer.utils.batch_helpers``: reading and replacing one part of a batch
(:func:`lockstep.batch.batch_get`, :func:`lockstep.batch.batch_set`)."""

from lockstep.batch import batch_get, batch_set

__all__ = ["batch_get", "batch_set"]
