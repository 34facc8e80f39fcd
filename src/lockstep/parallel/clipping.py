"""Gradient clipping by the norm over every rank and shard, and adaptive clipping.

Under DDP each rank holds the whole synchronized gradient, so the local norm is the global one.
Under FSDP a gradient is a DTensor whose rank holds one shard; its norm is a partial value until
it is reduced over the mesh. Gradients are grouped by mesh and placement, each group's norm is
reduced once, and the groups' norms are combined: one collective per group, not per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from lockstep.dtensors import is_dtensor


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of all of ``grads`` taken together, as a plain tensor on every rank."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), g.placements) if is_dtensor(g) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    if not norms:
        return torch.zeros(())
    if len(norms) == 1:  # as clip_grad_norm_ computes it, to the bit
        return norms[0]
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so that their joint norm is at most ``max_norm``,
    as ``torch.nn.utils.clip_grad_norm_`` does in one process; returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = total_norm([p.grad for p in params], norm_type)  # type: ignore[misc]
    on_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:  # one scaling per mesh: under tensor parallelism the parameters lie on two
        on_mesh.setdefault(id(p.grad.device_mesh) if is_dtensor(p.grad) else None, []).append(p)
    for group in on_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def clip_adaptive(params: Sequence[torch.nn.Parameter], threshold: float) -> None:
    """Scale each unit's gradient (a row of a matrix, or a whole vector) whose norm exceeds
    ``threshold`` times the unit's weight norm down to that bound, in place."""
    for p in params:
        if p.grad is None:
            continue
        weight_norm = _unit_norm(p.detach()).clamp(min=1e-3)
        grad_norm = _unit_norm(p.grad.detach())
        bound = weight_norm * threshold
        scaled = p.grad.detach() * (bound / grad_norm.clamp(min=1e-6))
        p.grad.detach().copy_(torch.where(grad_norm > bound, scaled, p.grad.detach()))


def _unit_norm(t: torch.Tensor) -> torch.Tensor:
    if t.ndim <= 1:
        return torch.linalg.vector_norm(t)
    return torch.linalg.vector_norm(t, dim=tuple(range(1, t.ndim)), keepdim=True)
