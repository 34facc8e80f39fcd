"""A training loader made to yield this rank's share of each global batch of the full world."""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lockstep.elastic.global_batches import GlobalBatchSampler
from lockstep.launcher.elastic_names import FULL_WORLD_ENV



def full_world_size() -> int | None:
    """``LOCKSTEP_FULL_WORLD_SIZE``, checked; None when unset."""
    value = os.environ.get(FULL_WORLD_ENV)
    if value is None or value == "":
        return None
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"{FULL_WORLD_ENV}={value!r} is not a number of ranks: set it to an integer >= 1, or unset it")
    return size


def share_loader(loader: Any, name: str, full_world: int, world: int, rank: int, *, regrouped: bool = False) -> Any:
    """``loader``, or a DataLoader (a StatefulDataLoader for one) over the same data and with the
    same settings, that gives rank ``rank`` of ``world`` its share of each global batch of
    ``full_world`` ranks (the loader's ``batch_size`` samples per full-world rank, drawn as its
    DistributedSampler draws them).
    A loader made by this function is re-split in place; with the full world there, and a loader
    never split, the loader is returned as it is: its batches are the global batch's shares. Not
    once the ranks ``regrouped`` (a rank joined the running job): the others' loaders split the
    global batch in contiguous shares, which the DistributedSampler's interleaved ones are not.
    A loader that could not be split is refused even then (ValueError), before the first step."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, GlobalBatchSampler):
        batch_sampler.split(world, rank)
        return loader
    sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else None
    # refused before the first step too, not hours later at the first change of the ranks
    if (not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset)
            or not isinstance(sampler, DistributedSampler) or loader.batch_size is None):
        raise ValueError(
            f"{name} cannot be split into shares of the global batch of {full_world} ranks ({FULL_WORLD_ENV}) "
            f"over however many train, as an elastic job does when its ranks change: build it as "
            f"DataLoader(dataset, batch_size=..., "
            f"sampler=lockstep.dist.get_sampler(dataset, shuffle=...)) over a map-style dataset")
    if world == full_world and not regrouped:
        return loader
    shares = GlobalBatchSampler(loader.dataset, full_world=full_world, per_rank_batch=loader.batch_size,  # type: ignore[arg-type]
                                world=world, rank=rank, shuffle=sampler.shuffle, seed=sampler.seed,
                                drop_last=sampler.drop_last, drop_last_batch=loader.drop_last)
    shares.set_epoch(sampler.epoch)
    workers = loader.num_workers
    settings: dict[str, Any] = dict(
        batch_sampler=shares, num_workers=workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None, persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device, in_order=loader.in_order)
    stateful = _stateful_dataloader_class(loader)
    if stateful is not None:  # it stays one, saving its dataset's state into each checkpoint
        return stateful(loader.dataset, snapshot_every_n_steps=loader.snapshot_every_n_steps, **settings)
    return DataLoader(loader.dataset, **settings)


def _stateful_dataloader_class(loader: DataLoader) -> type | None:
    """torchdata's StatefulDataLoader where ``loader`` is one (found without importing torchdata,
    which is optional)."""
    return next((c for c in type(loader).__mro__
                 if c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata.")), None)
