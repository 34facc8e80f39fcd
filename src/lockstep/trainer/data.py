"""Dataloader rules: sampler checks, set_epoch, ranks stopping together, eval padding."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lockstep import dist


def _sampler(loader: Any) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, BatchSampler):
        return batch_sampler.sampler
    return getattr(loader, "sampler", None)


def check_distributed_sampler(loader: Any, name: str) -> None:
    """With world size > 1 a map-style dataset must be split over ranks by a DistributedSampler."""
    if dist.get_world_size() == 1 or not isinstance(loader, DataLoader):
        return
    if isinstance(loader.dataset, IterableDataset):
        return
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and not isinstance(batch_sampler, BatchSampler):
        return  # a custom batch sampler splits the data itself
    if not isinstance(_sampler(loader), DistributedSampler):
        raise ValueError(
            f"{name} has a map-style dataset but its sampler is {type(_sampler(loader)).__name__}, "
            f"so every rank would train on the same data: build it with "
            f"DataLoader(dataset, batch_size=..., sampler=lockstep.dist.get_sampler(dataset))")


def set_epoch(loader: Any, epoch: int) -> None:
    """Reshuffle per epoch: DistributedSampler (and anything else with set_epoch) needs the call."""
    seen = set()
    for obj in (_sampler(loader), getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
        if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
            seen.add(id(obj))
            obj.set_epoch(epoch)


def equal_batches_guaranteed(loader: Any) -> bool:
    """True when every rank gets the same number of batches of the same sizes, so no per-step
    agreement is needed: a DistributedSampler pads or drops to equal shares."""
    return (isinstance(loader, DataLoader) and loader.batch_size is not None
            and isinstance(_sampler(loader), DistributedSampler))


def epoch_batches(loader: Any, count: Any, sync: bool, device: torch.device) -> Iterator[tuple[Any, int, int, bool]]:
    """Yield ``(batch, global_samples, global_tokens, is_last)`` for one epoch.

    It reads one batch ahead to know which batch is the epoch's last. With ``sync``, one small
    all-reduce per batch makes every rank agree on the global counts and on the end of the epoch,
    so ranks whose loaders have different lengths stop together instead of hanging in DDP.
    ``count(batch) -> (samples, tokens)`` counts one rank's batch.
    """
    world_size = dist.get_world_size()
    it = iter(loader)
    current = next(it, None)
    if sync:
        if _agree([0, 0, current is None], device)[2] > 0:
            return
    elif current is None:
        return
    while True:
        following = next(it, None)
        samples, tokens = count(current)
        if sync:
            samples, tokens, missing = _agree([samples, tokens, following is None], device)
            is_last = missing > 0
        else:
            samples, tokens, is_last = samples * world_size, tokens * world_size, following is None
        yield current, samples, tokens, is_last
        if is_last:
            return
        current = following


def _agree(values: list[int], device: torch.device) -> list[int]:
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    return [int(v) for v in dist.all_reduce(t, "SUM").tolist()]


def real_eval_samples(loader: Any) -> int | None:
    """How many of this rank's eval samples are real: DistributedSampler pads the last ranks'
    shares with repeats of the first samples, and those must not count twice in the metrics."""
    sampler = _sampler(loader)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    total = len(sampler.dataset)  # type: ignore[arg-type]
    return len(range(sampler.rank, total, sampler.num_replicas))
