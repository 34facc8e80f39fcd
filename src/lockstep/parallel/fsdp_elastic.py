"""FSDP in an elastic job: collectives that a change of the ranks ends, and the model sharded anew
over the ranks left.

A lost rank takes its shards with it, and FSDP2 cannot move a sharded module onto another process
group. So the strategy keeps, from before the first sharding, a skeleton of the model
(:mod:`lockstep.parallel.skeleton`). After a change the skeleton is materialized and sharded over
the new group; the Trainer then loads the last checkpoint into it, resharded to the new world size.

FSDP waits for its all-gathers and reduce-scatters inside torch, where a peer that another
survivor stopped talking to blocks a rank until the group's timeout. :class:`WaitedAllGather` and
:class:`WaitedReduceScatter` issue them through :func:`lockstep.dist.run_collective` instead, whose
wait an elastic job's membership polls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lockstep import dist

# torch 2.13 names them *_single (the older names warn); older versions have only the older names
_ALL_GATHER = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(torch_dist, "reduce_scatter_single", None) or torch_dist.reduce_scatter_tensor


class _PlainBuffers:
    """The buffers of FSDP's ``Comm`` interface: plain tensors, as FSDP's default collectives use."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class WaitedAllGather(_PlainBuffers):
    """FSDP's all-gather (the ``AllGather`` interface of ``FSDPModule.set_custom_all_gather``),
    waited for through :func:`lockstep.dist.run_collective`; done when it returns."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        dist.run_collective(_ALL_GATHER, output_tensor, input_tensor, group=group)


class WaitedReduceScatter(_PlainBuffers):
    """FSDP's reduce-scatter, waited for as :class:`WaitedAllGather` is."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        if torch_dist.get_backend(group) != "gloo":
            dist.run_collective(_REDUCE_SCATTER, output_tensor, input_tensor, op=op, group=group)
            return
        # gloo's reduce-scatter work never reports that it completed, so a polled wait would never
        # end: an all-reduce of the whole input (FSDP's scratch buffer, summed in place), and this
        # rank's part of it
        dist.run_collective(torch_dist.all_reduce, input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()].view_as(output_tensor))


def wait_through_lockstep(modules: Sequence[nn.Module]) -> None:
    """Have every FSDP unit among ``modules`` gather and reduce through :mod:`lockstep.dist`."""
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(WaitedAllGather())  # type: ignore[arg-type]
            module.set_custom_reduce_scatter(WaitedReduceScatter())  # type: ignore[arg-type]


def wait_dcp_through_lockstep() -> None:
    """Have DCP's collectives (its ``_DistWrapper``'s: the save and load plans gathered and
    scattered, the metadata broadcast, the barriers) go through :mod:`lockstep.dist`, whose waits a
    change of the ranks ends: a ``sharded`` checkpoint's write meets in them, and a rank lost
    during it would otherwise hold the others there until the group's timeout."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    _DistWrapper.broadcast_object = _broadcast_object  # type: ignore[method-assign]
    _DistWrapper.all_gather_object = _all_gather_object  # type: ignore[method-assign]
    _DistWrapper.gather_object = _gather_object  # type: ignore[method-assign]
    _DistWrapper.scatter_object = _scatter_object  # type: ignore[method-assign]
    _DistWrapper.barrier = _barrier  # type: ignore[method-assign]


def _broadcast_object(self: Any, obj: Any) -> Any:
    objects = [obj]
    if self.use_dist:
        dist.broadcast_object_list(objects, src=self.global_coordinator_rank, group=self.group)
    return objects[0]


def _all_gather_object(self: Any, obj: Any) -> list[Any]:
    return dist.all_gather_object(obj, group=self.group) if self.use_dist else [obj]


def _gather_object(self: Any, obj: Any) -> list[Any] | None:
    if not self.use_dist:
        return [obj]
    return dist.gather_object(obj, dst=self.global_coordinator_rank, group=self.group)


def _scatter_object(self: Any, objects: list[Any] | None) -> Any:
    if not self.use_dist:
        assert objects is not None
        return objects[0]
    return dist.scatter_object(objects, src=self.global_coordinator_rank, group=self.group)


def _barrier(self: Any) -> None:
    if self.use_dist:
        dist.barrier(group=self.group)
