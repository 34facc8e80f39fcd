"""The global batch as the unit of data, whatever the number of ranks that train on it.

A job launched for a full world of F ranks, each with a per-rank batch of B samples drawn by a
``DistributedSampler`` (``dist.get_sampler``), trains at step ``s`` on global batch ``s``: the union
of every rank's batch ``s``. Rank ``r``'s sample ``j`` is element ``j * F + r`` of the sampler's
shuffled (and padded, or cut) index list, so global batch ``s`` is the contiguous slice
``[s * B * F, (s + 1) * B * F)`` of that list. :class:`GlobalBatchSampler` yields one rank's share
of that slice for any number of ranks W <= F: the global batches, their samples and their order
never depend on W, only their split over the ranks does (shares differ by at most one sample).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from lockstep.launcher.elastic_names import FULL_WORLD_ENV


def per_rank_samples(size: int, world: int, drop_last: bool) -> int:
    """The samples a ``DistributedSampler`` gives each of ``world`` ranks out of ``size``: padded
    up to equal shares, or cut down to them (``drop_last``)."""
    return math.ceil((size - world) / world) if drop_last and size % world else math.ceil(size / world)


def check_world(world: int, full_world: int) -> None:
    """At most the full world's ranks share its global batch."""
    if not 1 <= world <= full_world:
        raise ValueError(f"{world} ranks train, more than the full world of {full_world} that the global batch is "
                         f"made for: raise {FULL_WORLD_ENV} to at least {world}, or unset it")


def index_order(size: int, full_world: int, *, shuffle: bool, seed: int, epoch: int, drop_last: bool) -> list[int]:
    """The index list a ``DistributedSampler`` over ``size`` samples for ``full_world`` ranks
    draws in ``epoch``, before it deals the indices out to the ranks: shuffled with ``seed +
    epoch`` (if ``shuffle``), then padded with its first indices to a multiple of the ranks, or
    cut to one (``drop_last``)."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist() if shuffle \
        else list(range(size))
    total = per_rank_samples(size, full_world, drop_last) * full_world
    if total <= len(order):
        return order[:total]
    padding = total - len(order)
    return order + (order * math.ceil(padding / len(order)))[:padding]


def share_bounds(global_size: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of ``global_size`` samples split over ``world`` ranks: the
    first ``global_size % world`` ranks take one sample more."""
    base, extra = divmod(global_size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class GlobalBatchSampler(Sampler[list[int]]):
    """A batch sampler that yields this rank's share of each global batch.

    ``full_world`` ranks with ``per_rank_batch`` samples each make a global batch; ``world`` ranks
    train on it now, this one being ``rank``. ``shuffle``, ``seed`` and ``drop_last`` are the
    ``DistributedSampler``'s, ``drop_last_batch`` the ``DataLoader``'s (a last global batch with
    fewer than ``per_rank_batch`` samples per full-world rank is dropped). ``set_epoch`` reshuffles,
    as the ``DistributedSampler`` does.
    """

    def __init__(self, dataset: Sized, *, full_world: int, per_rank_batch: int, world: int, rank: int,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, drop_last_batch: bool = False) -> None:
        self.dataset, self.full_world, self.per_rank_batch = dataset, full_world, per_rank_batch
        self.shuffle, self.seed, self.drop_last, self.drop_last_batch = shuffle, seed, drop_last, drop_last_batch
        self.epoch = 0
        self.split(world, rank)

    def split(self, world: int, rank: int) -> None:
        """Give rank ``rank`` of ``world`` its shares from now on."""
        check_world(world, self.full_world)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not one of {world} ranks")
        self.world, self.rank = world, rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """Global batches per epoch: what ``len()`` of a full-world rank's ``DataLoader`` gives."""
        samples = per_rank_samples(len(self.dataset), self.full_world, self.drop_last)
        return samples // self.per_rank_batch if self.drop_last_batch else math.ceil(samples / self.per_rank_batch)

    def __iter__(self) -> Iterator[list[int]]:
        order = index_order(len(self.dataset), self.full_world, shuffle=self.shuffle, seed=self.seed,
                            epoch=self.epoch, drop_last=self.drop_last)
        step = self.per_rank_batch * self.full_world
        for s in range(len(self)):
            global_batch = order[s * step:(s + 1) * step]
            start, end = share_bounds(len(global_batch), self.world, self.rank)
            yield global_batch[start:end]
