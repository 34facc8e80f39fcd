"""Gathers of an elastic job that a change of its ranks ends: through :mod:`lockstep.dist`, whose
waits the membership watches (:mod:`lockstep.elastic.membership`)."""

from __future__ import annotations

from typing import Any

import torch

from lockstep import dist


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
