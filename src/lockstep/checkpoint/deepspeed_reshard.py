"""A DeepSpeed checkpoint of ZeRO stage 1 or 2 loaded at another world size (an elastic job).

DeepSpeed's engine refuses to load optimizer partitions saved by another number of ranks, and its
own merge (``elastic_checkpoint``) needs the step in the optimizer's param groups, where torch's
optimizers do not keep it. The layout it saves is simple, though: each rank's file holds its
contiguous slice of every parameter group flattened, the fp32 master weights without the padding
that ends the last slice, and the base optimizer's state of that slice (with that padding, unless
saved as an ``elastic_checkpoint``). So the
slices of all ranks, concatenated, are each group in full; this rank takes its slice of the new
partitioning from them. The module's weights come from the model states file, which is whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import CheckpointError

_OPTIMIZER = "optimizer_state_dict"


def load(engine: Any, folder: Path, tag: str, saved_world_size: int, *, strict: bool) -> None:
    """Load the checkpoint in ``folder/tag``, saved by ``saved_world_size`` ranks, into ``engine``
    (ZeRO stage 1 or 2, any world size): the module's weights, the fp32 master partitions and the
    base optimizer's state of this rank's slice."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS

    optimizer = engine.optimizer
    if not hasattr(optimizer, "single_partition_of_fp32_groups"):
        raise CheckpointError(f"checkpoint {folder}: lockstep cuts anew the partitions of DeepSpeed's ZeRO optimizer, "
                              f"not those of {type(optimizer).__name__}: resume it at the world size that saved it "
                              f"({saved_world_size})")
    loaded, _ = engine.load_checkpoint(str(folder), tag=tag, load_module_strict=strict, load_module_only=True)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {folder / tag}")
    saved = [_optimizer_part(folder / tag, rank) for rank in range(saved_world_size)]
    base = optimizer.optimizer
    rank = torch.distributed.get_rank(group=optimizer.dp_process_group)
    for g, partition in enumerate(optimizer.single_partition_of_fp32_groups):
        size = partition.numel()
        take = _slicer(rank * size, size)
        masters = [part[SINGLE_PARTITION_OF_FP32_GROUPS][g] for part in saved]  # without the padding
        partition.data.copy_(take(masters))
        states = [_group_state(part[BASE_OPTIMIZER_STATE], g) for part in saved]
        target = base.state[partition]
        for key, first in states[0].items():
            if torch.is_tensor(first) and first.dim() == 1:  # partitioned as the master weights
                pieces = [state[key][:master.numel()] for state, master in zip(states, masters)]
                target[key] = take(pieces).to(partition.device)
            else:  # the same on every rank (Adam's step: 0-dimensional)
                target[key] = first.clone() if torch.is_tensor(first) else first
    optimizer._load_global_state(saved[0])  # the loss scaler's state: the same on every rank


def _optimizer_part(folder: Path, rank: int) -> dict[str, Any]:
    names = sorted(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_*optim_states.pt"))
    if len(names) != 1:
        raise CheckpointError(f"{folder} holds {len(names)} optimizer partition file(s) of rank {rank}, not 1: "
                              f"a DeepSpeed checkpoint of pipeline or tensor parallelism does not reshard")
    part = torch.load(names[0], map_location="cpu", weights_only=False)  # checked by check_folder first
    return part[_OPTIMIZER]


def _group_state(base: Any, group: int) -> dict[str, Any]:
    """One group's state: from an ``elastic_checkpoint`` (a list, one per group) or a plain
    ``state_dict()`` of the base optimizer (its one flat parameter per group)."""
    return base[group] if isinstance(base, list) else base["state"][group]


def _slicer(start: int, size: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Of pieces that concatenated make a flat group: the ``size`` elements from ``start``,
    zero-padded past its end."""
    def take(pieces: list[torch.Tensor]) -> torch.Tensor:
        whole = torch.cat([p.reshape(-1).float() for p in pieces])
        out = torch.zeros(size, dtype=torch.float32)
        piece = whole[start:start + size]
        out[:piece.numel()] = piece
        return out
    return take
