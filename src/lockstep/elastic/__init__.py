"""Elastic training: the global batch of the full world as the unit of data, trained on by
however many ranks are there, and the ranks' membership in a job that goes on when one is lost
(DESIGN.md section 14)."""

from lockstep.elastic.change import RanksChanged
from lockstep.elastic.global_batches import GlobalBatchSampler
from lockstep.elastic.loader import FULL_WORLD_ENV, full_world_size, share_loader
from lockstep.elastic.membership import ELASTIC_ENV, Membership, MembershipChanged, current, join

__all__ = ["ELASTIC_ENV", "FULL_WORLD_ENV", "GlobalBatchSampler", "Membership", "MembershipChanged", "RanksChanged",
           "current",
           "full_world_size", "join", "share_loader"]
