"""Dataloader rules: sampler checks, set_epoch, ranks stopping together, mid-epoch resume, eval
padding, and workers that outlive a SIGTERM to the whole job."""

from __future__ import annotations

import hashlib
import itertools
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, SupportsInt

import torch
import torch.distributed as torch_dist
import torch.utils._pytree as pytree
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lockstep import _agreement, dist
from lockstep import rng
from lockstep.elastic.global_batches import per_rank_samples
from lockstep.parallel.mesh import data_parallel


class _IgnoreSigterm:
    """A DataLoader ``worker_init_fn`` that makes the worker ignore SIGTERM, then runs the user's.

    A scheduler that preempts a job signals every process in it. A worker killed by that signal
    takes its rank down (DataLoader raises "worker ... killed by signal") before the rank has
    written its preemption checkpoint. The rank decides when to stop; its workers end with it.
    """

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.user is not None:
            self.user(worker_id)


def shielded(loader: Any) -> Any:
    """``loader``, with its worker processes (if any) made to ignore SIGTERM."""
    if isinstance(loader, DataLoader) and loader.num_workers > 0 and not isinstance(loader.worker_init_fn,
                                                                                   _IgnoreSigterm):
        loader.worker_init_fn = _IgnoreSigterm(loader.worker_init_fn)
    return loader


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
            f"DataLoader(dataset, batch_size=..., sampler=lockstep.dist.get_sampler(dataset, shuffle=True))")


def split_over_data_parallel(loader: Any, name: str) -> None:
    """Under tensor parallelism the ranks of a group train on one share of the data: a
    DistributedSampler made for every rank (``dist.get_sampler``'s default) is split over the
    data-parallel ranks instead, so that the global batch is the same as without it."""
    split, sampler = data_parallel(), _sampler(loader)
    if not isinstance(sampler, DistributedSampler):
        return
    made_for = getattr(sampler, _MADE_FOR, None)  # a loader an earlier Trainer split: as it was made
    if split.copies == 1:
        if made_for is not None:
            _resplit(sampler, *made_for)
            delattr(sampler, _MADE_FOR)
        return
    if (sampler.num_replicas, sampler.rank) == (split.size, split.rank):
        return
    made_for = made_for or (sampler.num_replicas, sampler.rank)
    if made_for != (dist.get_world_size(), dist.get_global_rank()):
        raise ValueError(f"{name}'s DistributedSampler gives rank {made_for[1]} of {made_for[0]} its "
                         f"share, but under tensor parallelism this rank trains on share {split.rank} of "
                         f"{split.size}: build it with lockstep.dist.get_sampler(dataset)")
    setattr(sampler, _MADE_FOR, made_for)
    _resplit(sampler, split.size, split.rank)


def split_over_the_ranks_now(loader: Any) -> None:
    """In an elastic job, an eval loader's DistributedSampler, made for the ranks the job started
    with, is split over the ranks there are now (after a change, so that every sample is still
    evaluated once; the padding is left out as before)."""
    sampler = _sampler(loader)
    if not isinstance(sampler, DistributedSampler) or data_parallel().copies != 1:
        return
    now = (dist.get_world_size(), dist.get_global_rank())
    if (sampler.num_replicas, sampler.rank) != now:
        _resplit(sampler, *now)


_MADE_FOR = "_lockstep_made_for"
"""The (num_replicas, rank) a sampler had before :func:`split_over_data_parallel` changed it."""


def _resplit(sampler: DistributedSampler, num_replicas: int, rank: int) -> None:
    sampler.num_replicas, sampler.rank = num_replicas, rank
    sampler.num_samples = per_rank_samples(len(sampler.dataset), num_replicas, sampler.drop_last)  # type: ignore[arg-type]
    sampler.total_size = sampler.num_samples * num_replicas


def check_groups_share_batches(batch: Any) -> None:
    """Under tensor parallelism, once per ``fit`` (a collective): the ranks of each group got the
    same batch, else a ValueError on every rank; a loader that splits its data by global rank (an
    ``IterableDataset``, a custom sampler) would otherwise train each group on mismatched halves."""
    split = data_parallel()
    if split.copies == 1:
        return
    digest = hashlib.sha256()
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            digest.update(leaf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(leaf).encode())
    digests = _agreement.gather_small_objects(digest.hexdigest())
    for first in range(0, len(digests), split.copies):
        group = range(first, first + split.copies)
        if len({digests[r] for r in group}) > 1:
            raise ValueError(f"under tensor parallelism the ranks of a group train on one batch, but ranks "
                             f"{group[0]}-{group[-1]} got different ones: build the train dataloader on a map-style "
                             f"dataset with lockstep.dist.get_sampler(dataset), or have each rank of a group "
                             f"yield the same batches")


def set_epoch(loader: Any, epoch: int) -> None:
    """Reshuffle per epoch: DistributedSampler (and anything else with set_epoch) needs the call."""
    seen = set()
    for obj in (_sampler(loader), getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
        if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
            seen.add(id(obj))
            obj.set_epoch(epoch)


def spin(train_loader: Any, completed_epochs: int, eval_loaders: list[Any]) -> None:
    """Composer's dataloader spin at the start of ``fit``, before a resumed run's RNG state is put
    back: the first batch of each evaluation loader, then of ``train_loader`` (None: not spun) in
    each epoch already done. Whatever the data draws from the global generators when it is first
    read (a dataset made lazily at random, a sampler without a seed of its own) is then drawn
    where an uninterrupted run drew it, so the resumed run reads the same data."""
    for loader in eval_loaders:
        if isinstance(_sampler(loader), DistributedSampler):
            _sampler(loader).set_epoch(0)
        _first_batch(loader)
    if train_loader is None:
        return
    for epoch in range(completed_epochs):
        set_epoch(train_loader, epoch)
        _first_batch(train_loader)


def _first_batch(loader: Any) -> None:
    iterator = iter(loader)
    try:
        next(iterator, None)
    finally:
        del iterator  # a DataLoader's workers stop with their iterator


def equal_batches_guaranteed(loader: Any) -> bool:
    """True when every rank gets the same number of batches of the same sizes, so no per-step
    agreement is needed: a DistributedSampler pads or drops to equal shares."""
    return (isinstance(loader, DataLoader) and loader.batch_size is not None
            and isinstance(_sampler(loader), DistributedSampler))


@dataclass(slots=True)
class DataPosition:
    """Where this rank's data stream stands inside an epoch, for an exact mid-epoch resume.

    ``epoch_rng`` is the RNG state when the epoch's iterator was created (a sampler without its own
    generator, and the DataLoader's worker seed, draw from it); ``fetch_rng`` the state before the
    batch read ahead was fetched (dataset code may draw from it). ``skip`` batches are passed over.
    """

    epoch_rng: rng.RNGState | None = None
    fetch_rng: rng.RNGState | None = None
    skip: int = 0
    rng_after: rng.RNGState | None = None
    """On resume: the state to restore once the data is back in place (the state at the save)."""
    loader_state: dict[str, Any] | None = None
    """A stateful loader's ``state_dict()`` after the newest batch it yielded for training."""
    by_dataset: bool = False
    """On resume: the train dataset put itself back in place (its ``load_state_dict`` took the
    checkpoint's ``dataset_state``, as mosaicml-streaming's ``StreamingDataset`` does), so nothing is
    passed over (Composer's ``dataset_resumption['train']``)."""


def rank_entry(position: DataPosition, at_epoch_end: bool) -> dict[str, Any]:
    """This rank's part of a checkpoint: its RNG state and, mid-epoch, where its data stream stands."""
    mid_epoch = not at_epoch_end
    return {"rng": rng.capture(),
            "epoch_rng": position.epoch_rng if mid_epoch else None,
            "fetch_rng": position.fetch_rng if mid_epoch else None,
            "loader_state": position.loader_state if mid_epoch else None}


def resume_position(entry: dict[str, Any] | None, batch_in_epoch: int, position: DataPosition, *,
                    by_dataset: bool = False) -> DataPosition | None:
    """Where ``fit`` starts this rank's data: None at an epoch's start (after restoring a loaded
    checkpoint's RNG state), else the position to resume mid-epoch from. ``entry`` is this rank's
    part of a loaded checkpoint; without one, ``fit`` runs again after an earlier ``fit`` ended
    mid-epoch (from ``position``). ``by_dataset``: the checkpoint put the train dataset back in
    place itself (:attr:`DataPosition.by_dataset`)."""
    if entry is None:
        if batch_in_epoch == 0:
            return None
        # finish the epoch, skipping the batches it already trained on
        return DataPosition(epoch_rng=position.epoch_rng, skip=batch_in_epoch)
    # An empty entry: a sharded checkpoint of another world size, whose RNG streams do not map
    # onto these ranks. The data position still does when the global batch is the same.
    if batch_in_epoch == 0:
        if entry and entry.get("rng") is not None:  # None: load_ignore_keys left it out
            rng.restore(entry["rng"])
        return None
    return DataPosition(epoch_rng=entry.get("epoch_rng"), fetch_rng=entry.get("fetch_rng"), skip=batch_in_epoch,
                        rng_after=entry.get("rng"), loader_state=entry.get("loader_state"), by_dataset=by_dataset)


def is_stateful(loader: Any) -> bool:
    """A loader that saves and restores its own position (torchdata's StatefulDataLoader, or any
    with ``state_dict``/``load_state_dict``): resuming restores it instead of passing over batches."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def resume_caveat(loader: Any, epoch: int) -> str | None:
    """Why resuming ``loader`` at ``epoch`` cannot be exact, if it cannot: workers that persist
    across epochs carry their random state from one epoch into the next, and nothing outside them
    can read it (a resume in the first epoch replays its batches, so its workers match)."""
    if (epoch == 0 or not isinstance(loader, DataLoader) or loader.num_workers == 0
            or not loader.persistent_workers or is_stateful(loader)):
        return None
    return ("train_dataloader has persistent_workers=True: its workers' random state carries over from "
            "epoch to epoch and is not in the checkpoint, so randomness drawn inside workers (e.g. data "
            "augmentation) differs from an uninterrupted run after this resume. For an exact resume, use "
            "persistent_workers=False, or torchdata's StatefulDataLoader with a dataset that saves its "
            "generator in state_dict()")


def epoch_batches(loader: Any, count: Any, sync: bool, device: torch.device, *, sum_tokens: bool = False,
                  track: DataPosition | None = None, resume: DataPosition | None = None,
                  limit: int | None = None,
                  transform: Callable[[Any], Any] | None = None) -> Iterator[tuple[Any, int, SupportsInt, bool]]:
    """Yield ``(batch, global_samples, global_tokens, is_last)`` for one epoch.

    When every rank is known to get ``len(loader)`` equal batches, the last batch is known by
    count. Otherwise it reads one batch ahead, and with ``sync`` one small all-reduce per batch
    makes every rank agree on the global counts and on the end of the epoch, so ranks whose
    loaders have different lengths stop together instead of hanging in DDP.
    With equal batches and ``sum_tokens`` (ranks may count different tokens), the tokens are
    summed by an all-reduce started as the batch is read: ``int(global_tokens)`` waits for it, so
    read it after the step, which it overlaps.
    ``count(batch) -> (samples, tokens)`` counts one rank's batch. With ``track``, the RNG states
    a checkpoint needs are recorded in it; ``resume`` puts the stream back where one was saved.
    ``limit`` ends the epoch after that many batches (``train_subset_num_batches``).
    ``transform`` (a DataSpec's ``batch_transforms``) changes each batch before it is counted.
    """
    length = len(loader) if not sync and equal_batches_guaranteed(loader) else None
    if length is not None and limit is not None:
        length = min(length, limit)
    if resume is not None and resume.epoch_rng is not None:
        rng.restore(resume.epoch_rng)
    if track is not None:
        track.epoch_rng, track.fetch_rng, track.loader_state = rng.capture(), None, None
    done = resume.skip if resume else 0
    # the state after each batch, when a checkpoint may need it
    state_of = loader.state_dict if track is not None and is_stateful(loader) else None
    it = _iter_from(loader, resume)
    if limit is not None:
        it = itertools.islice(it, max(limit - done, 0))
    if transform is not None:
        it = map(transform, it)
    if length is not None:
        yield from _counted(it, length, done, count, track, state_of, resume, sum_tokens)
    else:
        yield from _read_ahead(it, count, sync, device, track, state_of, resume)


def _iter_from(loader: Any, resume: DataPosition | None) -> Iterator[Any]:
    """An iterator over ``loader`` from where ``resume`` puts it: a stateful loader given its
    saved state, a dataset that put itself back in place as it is, a plain loader past the
    batches already trained. A plain loader reads them again and drops them, as an uninterrupted
    run read them: whatever fetching does (a dataset made lazily at random on its first read, a
    cache, workers advancing their RNGs per sample) then happens as it did there."""
    restored = resume is not None and resume.loader_state is not None and is_stateful(loader)
    if restored:
        loader.load_state_dict(resume.loader_state)  # type: ignore[union-attr]
    it = iter(loader)
    if resume is None or restored or resume.by_dataset:
        return it
    for _ in range(resume.skip):
        if next(it, None) is None:
            raise ValueError(f"cannot resume: train_dataloader ended within the {resume.skip} batches "
                             f"this epoch had already trained on")
    return it


def _counted(it: Iterator[Any], length: int, done: int, count: Any, track: DataPosition | None,
             state_of: Any, resume: DataPosition | None,
             sum_tokens: bool) -> Iterator[tuple[Any, int, SupportsInt, bool]]:
    world_size = data_parallel().size
    if resume is not None and resume.rng_after is not None:
        rng.restore(resume.rng_after)
    for index in range(done, length):
        batch = next(it, None)
        if batch is None:
            raise ValueError(f"train_dataloader has len() == {length} but yielded only {index} batches")
        if state_of is not None:
            track.loader_state = state_of()  # type: ignore[union-attr]
        samples, tokens = count(batch)
        yield (batch, samples * world_size, TokenSum(tokens) if sum_tokens else tokens * world_size,
               index == length - 1)


def _read_ahead(it: Iterator[Any], count: Any, sync: bool, device: torch.device, track: DataPosition | None,
                state_of: Any, resume: DataPosition | None) -> Iterator[tuple[Any, int, int, bool]]:
    world_size = data_parallel().size

    def fetch() -> Any:
        if track is not None:
            track.fetch_rng = rng.capture()
            if state_of is not None:  # before the read-ahead: the state after the batch being trained
                track.loader_state = state_of()
        return next(it, None)

    if resume is not None and resume.fetch_rng is not None:
        rng.restore(resume.fetch_rng)
    current = fetch()
    if resume is not None and resume.rng_after is not None:
        rng.restore(resume.rng_after)
    if sync:
        if _agree([0, 0, current is None], device)[2] > 0:
            return
    elif current is None:
        return
    while True:
        following = fetch()
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


class TokenSum:
    """One batch's token count summed over the ranks, by an all-reduce started at construction and
    waited for by ``int()``: it overlaps the step instead of delaying it."""

    __slots__ = ("_tensor", "_work")

    def __init__(self, tokens: int) -> None:
        self._tensor = torch.tensor([tokens], dtype=torch.int64)
        self._work: Any = torch_dist.all_reduce(self._tensor, group=_agreement.host_group(), async_op=True)

    def __int__(self) -> int:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._tensor //= data_parallel().copies  # each share's count, once per tensor-parallel rank
        return int(self._tensor[0])


def _agree(values: list[int], device: torch.device) -> list[int]:
    """Samples, tokens (each share counted once) and how many ranks ended, over every rank."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    samples, tokens, ended = (int(v) for v in dist.all_reduce(t, "SUM").tolist())
    copies = data_parallel().copies
    return [samples // copies, tokens // copies, ended]


def real_eval_samples(loader: Any) -> int | None:
    """How many of this rank's eval samples are real: DistributedSampler pads the last ranks'
    shares with repeats of the first samples, and those must not count twice in the metrics."""
    sampler = _sampler(loader)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    total = len(sampler.dataset)  # type: ignore[arg-type]
    return len(range(sampler.rank, total, sampler.num_replicas))
