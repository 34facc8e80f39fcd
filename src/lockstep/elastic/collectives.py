"""Gathers of an elastic job that a change of its ranks ends: through :mod:`lockstep.dist`, whose
waits the membership watches (:mod:`lockstep.elastic.membership`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lockstep import dist
from lockstep.elastic.membership import current


def gather_all_tensors(result: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``result``, ordered by rank, whatever each one's shape: torchmetrics'
    ``dist_sync_fn`` contract (its own gather waits inside torch, where a lost peer blocks it)."""
    result = result.contiguous()
    if result.ndim == 0:
        return dist.all_gather(result, group)
    shape = torch.tensor(result.shape, dtype=torch.int64, device=result.device)
    shapes = [tuple(int(n) for n in s) for s in dist.all_gather(shape, group)]
    largest = [max(sizes) for sizes in zip(*shapes)]
    padded = result.new_zeros(largest)
    padded[tuple(slice(0, n) for n in result.shape)] = result
    gathered = dist.all_gather(padded, group)
    return [g[tuple(slice(0, n) for n in s)] for g, s in zip(gathered, shapes)]


def gather_metrics_through_lockstep(metrics: Iterable[Any]) -> None:
    """In an elastic job, have each torchmetrics ``Metric`` of ``metrics`` gather with
    :func:`gather_all_tensors`, so that a change of the job's ranks ends its wait; else nothing."""
    if current() is not None:
        for metric in metrics:
            metric.dist_sync_fn = gather_all_tensors
