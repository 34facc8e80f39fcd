"""A model's skeleton: its modules with every parameter and buffer on the meta device.

A backend that shards parameters in place (FSDP, DeepSpeed ZeRO-3) cannot move a sharded module
onto another process group, and a lost rank takes its shards with it. So an elastic job keeps,
from before the first sharding, a skeleton of the model (no memory); after a change of the ranks
a new model is made from it, the optimizers are pointed at its parameters by name, and the
backend shards it over the ranks now in the job, for the last checkpoint to fill.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

_WRAPPED = "_checkpoint_wrapped_module."
"""The name part an activation-checkpointing wrapper adds (state dicts leave it out)."""


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (tied ones stay
    tied): its modules, attributes and wrap rules, without its memory."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def materialize(skeleton_model: nn.Module, device: torch.device, old: nn.Module) -> nn.Module:
    """A new model from ``skeleton_model`` on ``device``, with the buffers of ``old`` (neither FSDP
    nor ZeRO-3 shards buffers, so every rank still has them; a checkpoint overwrites the persistent
    ones). Its
    parameters are uninitialized: a checkpoint fills them."""
    model = copy.deepcopy(skeleton_model)
    ties = _ties(model)
    model.to_empty(device=device)  # gives each module its own tensor, tied or not
    for module, name, owner, owner_name in ties:
        setattr(module, name, getattr(owner, owner_name))
    kept = {name.replace(_WRAPPED, ""): buffer for name, buffer in old.named_buffers()}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name].to(buffer.dtype))
    return model


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Each parameter that a module shares with one met before: (module, name, owner, its name)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                ties.append((module, name, *first[id(param)]))
            else:
                first[id(param)] = (module, name)
    return ties


def parameter_names(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[list[list[str]]]:
    """Each optimizer's parameter groups as the names of their parameters in ``model``."""
    name_of = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    return [[[name_of[id(p)] for p in group["params"]] for group in o.param_groups] for o in optimizers]


def point_optimizers(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                     names: list[list[list[str]]]) -> None:
    """Point ``optimizers`` at ``model``'s parameters (by ``names``, from :func:`parameter_names`),
    with no state: the same objects, so that schedulers and callbacks that hold them still do."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for optimizer, groups in zip(optimizers, names):
        optimizer.state.clear()
        for group, group_names in zip(optimizer.param_groups, groups):
            group["params"] = [params[name] for name in group_names]
