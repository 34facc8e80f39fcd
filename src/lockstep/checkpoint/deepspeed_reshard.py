"""A DeepSpeed checkpoint of ZeRO stage 1, 2 or 3 loaded at another world size (an elastic job).

DeepSpeed's engine refuses to load optimizer partitions saved by another number of ranks, and its
own merge (``elastic_checkpoint``) needs the step in the optimizer's param groups, where torch's
optimizers do not keep it. The layout it saves is simple, though: each rank's file holds its
contiguous slice of every parameter group flattened, the fp32 master weights without the padding
that ends the last slice, and the base optimizer's state of that slice (with that padding, unless
saved as an ``elastic_checkpoint``). So the
slices of all ranks, concatenated, are each group in full; this rank takes its slice of the new
partitioning from them. The module's weights come from the model states file, which is whole.

ZeRO-3 partitions each parameter on its own: every rank holds ``ceil(numel / world size)``
elements of it (the last rank's slice padded), and a rank's flat fp32 partition is its slices of
the parameters one after another, in the order the model states file's ``param_shapes`` names
them. So each parameter is whole again as the ranks' slices of it end to end, and this rank's slice
of the new partitioning is cut from that; the base optimizer's state (Adam's moments) has the
layout of the fp32 partition and is cut the same way. DeepSpeed's own loader then copies the
fp32 partitions into the parameters' partitions, as on a resume at the same world size.
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
    (ZeRO stage 1, 2 or 3, any world size): the module's weights (and buffers), the fp32 master
    partitions and the base optimizer's state of this rank's slice."""
    if hasattr(engine.optimizer, "fp32_partitioned_groups_flat"):
        _load_stage3(engine, folder / tag, saved_world_size, strict=strict)
    else:
        _load_stage12(engine, folder, tag, saved_world_size, strict=strict)


def _load_stage12(engine: Any, folder: Path, tag: str, saved_world_size: int, *, strict: bool) -> None:
    optimizer = engine.optimizer
    if not hasattr(optimizer, "single_partition_of_fp32_groups"):
        raise CheckpointError(f"checkpoint {folder}: lockstep cuts anew the partitions of DeepSpeed's ZeRO optimizer, "
                              f"not those of {type(optimizer).__name__}: resume it at the world size that saved it "
                              f"({saved_world_size})")
    loaded, _ = engine.load_checkpoint(str(folder), tag=tag, load_module_strict=strict, load_module_only=True)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {folder / tag}")
    cut_stage12(engine, [_optimizer_part(folder / tag, rank) for rank in range(saved_world_size)])


def cut_stage12(engine: Any, saved: list[dict[str, Any]]) -> None:
    """ZeRO-1/2: this rank's fp32 master partition and the base optimizer's state of it cut from
    the optimizer states that every rank of another partitioning ``saved`` (in their rank order,
    as ``DeepSpeedZeroOptimizer.state_dict()`` makes them), and the loss scaler's state."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS

    optimizer = engine.optimizer
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


def _load_stage3(engine: Any, folder: Path, saved_world_size: int, *, strict: bool) -> None:
    """ZeRO-3: each parameter made whole from the saved ranks' slices, this rank's slice of it cut
    for the engine's partitioning, and the result given to DeepSpeed's loader as if this rank had
    saved it; the buffers from the model states file."""
    saved = [_optimizer_part(folder, rank) for rank in range(saved_world_size)]
    cut_stage3(engine, _model_states(folder), saved, folder.parent, strict=strict)


def cut_stage3(engine: Any, states: dict[str, Any], saved: list[dict[str, Any]], path: Path, *,
               strict: bool) -> None:
    """ZeRO-3: :func:`_load_stage3` from what every rank of another partitioning ``saved`` (their
    optimizer states, in rank order) and rank 0's model ``states`` (``param_shapes``, the
    buffers under ``module``); ``path`` names where they came from in an error."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

    optimizer = engine.optimizer
    layout = _Stage3Layout(states, len(saved))
    layout.check([[g.numel() for g in part[FP32_FLAT_GROUPS]] for part in saved], path)
    groups = [[(engine.param_names[p], p.ds_tensor.ds_numel) for p in group] for group in optimizer.fp16_groups]
    missing = {name for group in groups for name, _ in group} - set(layout.shapes)
    if missing:  # the model here is new from its skeleton: it has no values of its own to keep
        raise CheckpointError(f"checkpoint {path} has no parameter {sorted(missing)[0]!r} (and "
                              f"{len(missing) - 1} more) of this model: a ZeRO-3 checkpoint loads at another world "
                              f"size with every trainable parameter")
    rank = torch.distributed.get_rank(group=optimizer.dp_process_group)
    masters = layout.whole([torch.cat([g.reshape(-1).float() for g in part[FP32_FLAT_GROUPS]]) for part in saved])
    flats = [layout.cut(masters, group, rank, live.detach().float())
             for group, live in zip(groups, optimizer.fp32_partitioned_groups_flat)]
    state_dict = {LOSS_SCALER: saved[0][LOSS_SCALER], "dynamic_loss_scale": saved[0]["dynamic_loss_scale"],
                  "overflow": saved[0]["overflow"], FP32_FLAT_GROUPS: flats,
                  OPTIMIZER_STATE_DICT: _stage3_base_state(optimizer, saved, layout, groups, rank,
                                                           saved[0][FP32_FLAT_GROUPS][0].numel())}
    optimizer.checkpoint_event_prologue()
    try:  # DeepSpeed's own: the fp32 partitions into the parameters' partitions, and the base state
        optimizer._rigid_load_state_dict(state_dict, load_optimizer_states=True)
    finally:
        optimizer.checkpoint_event_epilogue()
    _load_buffers(engine.module, states["module"], path, strict=strict)


class _Stage3Layout:
    """Where each parameter lies in the flat partitions of a ZeRO-3 checkpoint of ``world_size``
    ranks: its ``ceil(numel / world_size)`` elements at the same offset in every rank's."""

    def __init__(self, model_states: dict[str, Any], world_size: int) -> None:
        if model_states.get("frozen_param_shapes"):
            raise CheckpointError("a ZeRO-3 checkpoint with frozen parameters (requires_grad=False) reshards to "
                                  "another world size only without them: resume it at the world size that saved it")
        self.shapes = {name: torch.Size(shape) for group in model_states["param_shapes"] for name, shape in group.items()}
        self.world_size = world_size
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = offset
            offset += -(-shape.numel() // world_size)

    def check(self, flat_sizes: list[list[int]], path: Path) -> None:
        """That every saved rank's flat partitions (their sizes, ``flat_sizes``) hold exactly the
        parameters' slices this layout places in them."""
        expected = sum(-(-shape.numel() // self.world_size) for shape in self.shapes.values())
        if any(sum(sizes) != expected for sizes in flat_sizes):
            raise CheckpointError(f"checkpoint {path}: its ZeRO-3 partitions hold {sum(flat_sizes[0])} elements a "
                                  f"rank where its parameters' shapes make {expected}: it does not reshard (saved "
                                  f"with expert or other parallel groups?); resume it at the world size that saved it")

    def whole(self, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each parameter's elements, flat, from every rank's flat partition (``flats``, in rank order)."""
        out = {}
        for name, shape in self.shapes.items():
            size, start = -(-shape.numel() // self.world_size), self.offsets[name]
            out[name] = torch.cat([flat[start:start + size] for flat in flats])[:shape.numel()]
        return out

    def cut(self, whole: dict[str, torch.Tensor], group: list[tuple[str, int]], rank: int,
            live: torch.Tensor) -> torch.Tensor:
        """This rank's flat partition of a sub-group of the new partitioning (``group``: its
        parameters' names and partition sizes, in order), zero-padded; a parameter the checkpoint
        lacks keeps its slice of ``live``, the engine's partition now."""
        pieces, offset = [], 0
        for name, size in group:
            if name in whole:
                piece = torch.zeros(size)
                mine = whole[name][rank * size:(rank + 1) * size]
                piece[:mine.numel()] = mine
            else:
                piece = live[offset:offset + size]
            pieces.append(piece)
            offset += size
        return torch.cat(pieces) if pieces else torch.zeros(0)


def _stage3_base_state(optimizer: Any, saved: list[dict[str, Any]], layout: _Stage3Layout,
                       groups: list[list[tuple[str, int]]], rank: int, first_size: int) -> dict[str, Any]:
    """The base optimizer's ``state_dict`` as this rank would have saved it under the engine's
    partitioning: each sub-group's state cut as its fp32 partition is (a parameter the checkpoint
    lacks starts with zeros), its parameter groups' settings as saved. ``first_size``: the
    elements of the first saved rank's first fp32 partition, which tell state laid out as it
    (Adam's moments) from the rest."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    bases = [part[OPTIMIZER_STATE_DICT] for part in saved]
    first = bases[0]["state"]
    partition = first[0] if first else {}
    laid_out = {}  # each parameter's state whole, per key laid out as the fp32 partition (Adam's moments)
    for key, value in partition.items():
        if torch.is_tensor(value) and value.numel() == first_size:  # the first saved sub-group's fp32 partition
            flats = [torch.cat([base["state"][g][key].reshape(-1).float() for g in sorted(base["state"])])
                     for base in bases]
            laid_out[key] = layout.whole(flats)
    state: dict[int, dict[str, Any]] = {}
    for index, group in enumerate(groups):
        zeros = torch.zeros(sum(size for _, size in group))
        state[index] = {key: layout.cut(laid_out[key], group, rank, zeros) if key in laid_out
                        else value.clone() if torch.is_tensor(value) else value  # the same for all (Adam's step)
                        for key, value in partition.items()}
    optimizer._set_fp32_optimizer_param_groups()
    try:
        live = optimizer.optimizer.state_dict()["param_groups"]
    finally:
        optimizer._clear_fp32_optimizer_param_groups()
    kept = bases[0]["param_groups"]
    if len(kept) != len(live):
        raise CheckpointError(f"the checkpoint's optimizer has {len(kept)} parameter group(s) and this one "
                              f"{len(live)}: they must match to resume")
    return {"state": state, "param_groups": [{**old, "params": new["params"]} for old, new in zip(kept, live)]}


def _model_states(folder: Path) -> dict[str, Any]:
    """Rank 0's model states file of a ZeRO-3 checkpoint (``param_shapes``, the buffers)."""
    names = sorted(folder.glob("*zero_pp_rank_0_mp_rank_*model_states.pt"))
    if len(names) != 1:
        raise CheckpointError(f"{folder} holds {len(names)} model states file(s) of rank 0, not 1: a DeepSpeed "
                              f"checkpoint of pipeline or tensor parallelism does not reshard")
    return torch.load(names[0], map_location="cpu", weights_only=False)  # checked by check_folder first


def _load_buffers(module: torch.nn.Module, saved: dict[str, Any], path: Path, *, strict: bool) -> None:
    """The module's persistent buffers from its saved ``state_dict`` (its parameters there are
    ZeRO-3's empty placeholders)."""
    persistent = set(module.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in saved:
                buffer.copy_(saved[name].to(buffer.dtype))
            elif strict and name in persistent:
                raise CheckpointError(f"checkpoint {path} has no buffer {name!r} of this model: pass "
                                      f"load_strict_model_weights=False to keep the model's own")


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
