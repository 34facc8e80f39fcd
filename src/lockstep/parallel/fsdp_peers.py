"""FSDP's state made whole from the ranks' own shards, for ranks that join a running elastic job.

When ranks join and none left, every shard of the model and of the optimizers' state is still on
the ranks that trained: the job need not go back to its last checkpoint. Each of those ranks sends
the shards it holds (CPU copies, with its place on the old mesh) to every rank of the new process
group; each rank puts every tensor together whole, and the model sharded anew over the larger world
takes its part of them, as it would take a ``full`` checkpoint's (every rank holds the whole state
for a moment, as when every rank reads such a checkpoint's file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from lockstep import dist

PEERS = Path("<the shards of the ranks that trained>")
"""What an error of state taken from peers names where a checkpoint's path would be."""


class _Shard:
    """One rank's dim-0 part of a sharded tensor (``torch.chunk``'s, as FSDP cuts them), on the CPU."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local


def own_shards(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What this rank holds of the model's and optimizers' state (by name, as DCP's state dicts
    key them), each sharded tensor as its :class:`_Shard`, and this rank's place on the mesh."""
    places: set[int] = set()

    def own(value: Any) -> Any:
        if isinstance(value, DTensor):
            if len(value.placements) != 1 or not value.placements[0].is_shard(0):
                raise ValueError(f"a tensor of placements {value.placements}: not FSDP's dim-0 sharding")
            places.add(value.device_mesh.get_local_rank())
            return _Shard(value.to_local().detach().cpu().clone())
        return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value

    state = pytree.tree_map(own, {"model": get_model_state_dict(model),
                                  "optimizers": [get_optimizer_state_dict(model, o) for o in optimizers]})
    if len(places) > 1:
        raise ValueError(f"this rank holds shards of several places on the mesh ({sorted(places)})")
    return {"place": places.pop() if places else dist.get_global_rank(), "state": state}


def whole_state(held: list[dict[str, Any] | None], own: dict[str, Any] | None) -> dict[str, Any]:
    """The model's and optimizers' state, each sharded tensor whole, from what every rank of the
    new group sent (``None`` from a rank that joined); ``own`` is this rank's (None if it joined):
    its unsharded tensors (buffers, which FSDP leaves per rank) are kept, and a rank that joined
    takes those of the first place on the old mesh."""
    by_place = sorted((h for h in held if h is not None), key=lambda h: h["place"])
    if not by_place:
        raise ValueError("no rank of the new group held any of the state")
    parts = [dict(pytree.tree_flatten_with_path(h["state"])[0]) for h in by_place]
    mine, spec = pytree.tree_flatten_with_path((own or by_place[0])["state"])
    whole = [torch.cat([p[path].local for p in parts]) if isinstance(leaf, _Shard) else leaf for path, leaf in mine]
    return pytree.tree_unflatten(whole, spec)
