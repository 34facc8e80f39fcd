"""Elastic training: the global batch of the full world as the unit of data, trained on by
however many ranks are there (DESIGN.md section 14)."""

from lockstep.elastic.global_batches import GlobalBatchSampler
from lockstep.elastic.loader import FULL_WORLD_ENV, full_world_size, share_loader

__all__ = ["FULL_WORLD_ENV", "GlobalBatchSampler", "full_world_size", "share_loader"]
