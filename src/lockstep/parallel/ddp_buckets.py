"""DDP's gradient buckets across a resume: read the layout a run reached, and start DDP with it.

DDP starts with all gradients in one bucket, in registration order, and after the first
synchronized backward rebuilds its buckets in the order the gradients became ready. Where a
gradient sits in the bucket it is reduced with decides how gloo's ring all-reduce groups its
sum over three or more ranks (over two, a + b is b + a). A resumed run whose DDP started over
with the initial bucket summed its first step in another order than the uninterrupted run, which
used the rebuilt buckets by then: last-bit differences from the first step on (issue 37). So a
DDP checkpoint records the rebuilt layout, and the resumed run's DDP starts with it.

A layout is bucket by bucket, the names of the parameters in the order they sit in the bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist
from torch import nn

from lockstep.checkpoint.states import ReplicatedLayout


class DDPStrategy(Protocol):
    """What a :class:`DDPLayout` reads of :class:`lockstep.parallel.ddp.DDPStrategy` (which imports this module)."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    buckets: BucketLayout | None

    def use_buckets(self, layout: Any) -> None: ...


BucketLayout = list[list[str]]
META_KEY = "ddp_buckets"
"""The checkpoint header field that holds the layout."""


def read(model: nn.Module, ignored: set[str]) -> BucketLayout | None:
    """The layout of DDP's buckets as the gradients show it right after a synchronized backward
    (with ``gradient_as_bucket_view`` each is a view into its bucket), or None when some gradient
    is not one. ``ignored``: parameters DDP leaves out."""
    buckets: dict[int, list[tuple[int, int, str]]] = {}
    for index, (name, p) in enumerate(model.named_parameters()):
        if not p.requires_grad or name in ignored:
            continue
        if p.grad is None:
            return None
        storage = p.grad.untyped_storage()
        buckets.setdefault(storage.data_ptr(), []).append((p.grad.storage_offset(), index, name))
    if not all(_tiles(sorted(members), model) for members in buckets.values()):
        return None
    # The bucket order only decides which bucket is sent first in the resumed run's first step
    # (DDP rebuilds its own order after it): DDP's own guess, the latest-registered first.
    ordered = sorted(buckets.values(), key=lambda members: -max(index for _, index, _ in members))
    return [[name for _, _, name in sorted(members)] for members in ordered]


def _tiles(members: list[tuple[int, int, str]], model: nn.Module) -> bool:
    """Whether the gradients fill one flat bucket end to end, one after another."""
    offset = 0
    for start, _, name in members:
        if start != offset:
            return False
        offset += model.get_parameter(name).numel()
    return True


def fits(layout: Any, model: nn.Module, ignored: set[str]) -> bool:
    """Whether ``layout`` (from a checkpoint) places every parameter DDP reduces exactly once."""
    if not isinstance(layout, list) or not all(isinstance(b, list) and b for b in layout):
        return False
    names = [name for bucket in layout for name in bucket]
    wanted = [n for n, p in model.named_parameters() if p.requires_grad and n not in ignored]
    return len(names) == len(set(names)) and sorted(names) == sorted(wanted)


@contextlib.contextmanager
def starting_with(layout: BucketLayout, model: nn.Module) -> Iterator[None]:
    """DDP built inside this block around ``model`` starts with the buckets of ``layout`` (which
    :func:`fits`) instead of its one initial bucket. DDP has no argument for this; its
    constructor asks ``torch.distributed._compute_bucket_assignment_by_size``, so that answers."""
    compute = torch_dist._compute_bucket_assignment_by_size
    ids = {id(p): name for name, p in model.named_parameters()}

    def assign(params: list[torch.Tensor], limits: list[int], *args: Any, **kwargs: Any) -> Any:
        place = {ids.get(id(p)): i for i, p in enumerate(params)}
        if set(place) != {name for bucket in layout for name in bucket}:
            return compute(params, limits, *args, **kwargs)
        buckets = [[place[name] for name in bucket] for bucket in layout]
        sizes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]
        # DDP reverses the buckets it is given (its guess that the last-registered are ready first)
        return list(reversed(buckets)), list(reversed(sizes))

    torch_dist._compute_bucket_assignment_by_size = assign
    try:
        yield
    finally:
        torch_dist._compute_bucket_assignment_by_size = compute


class DDPLayout(ReplicatedLayout):
    """DDP's single file, whose header also holds the layout of DDP's rebuilt gradient buckets."""

    def __init__(self, strategy: DDPStrategy) -> None:
        super().__init__(strategy.model, strategy.optimizers)
        self.strategy = strategy

    def extra_meta(self) -> dict[str, Any]:
        buckets = self.strategy.buckets
        return {META_KEY: [list(b) for b in buckets]} if buckets else {}

    def restore_meta(self, meta: dict[str, Any]) -> None:
        if meta.get(META_KEY):
            self.strategy.use_buckets(meta[META_KEY])
