"""Tensor parallelism: ``parallelism_config={'tp': {'tensor_parallel_degree': k, 'layer_plan': {...}}}``.

The layer plan maps module names (``fnmatch`` patterns such as ``blocks.*.mlp.0`` are allowed, as
in :func:`torch.distributed.tensor.parallel.parallelize_module`) to parallel styles such as
``ColwiseParallel()`` and ``RowwiseParallel()``. The named modules are split over the ranks of
each tensor-parallel group before FSDP shards the model over the data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

_KEYS = ("tensor_parallel_degree", "layer_plan")


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """A checked ``tp`` config."""

    degree: int
    plan: Mapping[str, Any]


def parse(config: Any) -> TensorParallel | None:
    """``parallelism_config['tp']`` (a dict or Composer's ``TPConfig``) checked; None when it asks
    for no tensor parallelism (degree 1, as Composer)."""
    from lockstep.utils.parallelism import TPConfig

    if config is None:
        return None
    if isinstance(config, TPConfig):
        config = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if not isinstance(config, Mapping):
        raise TypeError(f"parallelism_config['tp'] must be a dict or a TPConfig, got {type(config).__name__}")
    unknown = sorted(set(config) - set(_KEYS) - {"device_mesh"})
    if unknown:
        raise ValueError(f"parallelism_config['tp'] has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"valid keys: {', '.join(_KEYS)}")
    if config.get("device_mesh") is not None:
        raise ValueError("parallelism_config['tp']['device_mesh'] is made by the Trainer: give "
                         "tensor_parallel_degree instead")
    degree = config.get("tensor_parallel_degree", 1)
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"parallelism_config['tp']['tensor_parallel_degree']={degree!r} must be a positive integer")
    plan = config.get("layer_plan")
    if degree == 1:
        return None
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError("parallelism_config['tp'] needs a layer_plan: a dict of module names to styles such "
                         "as {'mlp.fc1': ColwiseParallel(), 'mlp.fc2': RowwiseParallel()}")
    from torch.distributed.tensor.parallel import ParallelStyle
    for name, style in plan.items():
        if not isinstance(name, str) or not isinstance(style, ParallelStyle):
            raise ValueError(f"layer_plan[{name!r}]={style!r}: the plan maps module names (str) to parallel "
                             f"styles such as ColwiseParallel() or RowwiseParallel()")
    return TensorParallel(degree, dict(plan))


def check_plan(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Every name of the plan names at least one module of ``model``; else a ValueError listing them."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in plan:
        atoms = pattern.split(".")
        if not any(_matches(name.split("."), atoms) for name in names):
            near = [n for n in names if n.split(".")[-1] == atoms[-1]] or names
            raise ValueError(f"layer_plan names {pattern!r}, which is no module of {type(model).__name__}: "
                             f"its modules include {', '.join(near[:8])}")


def _matches(parts: list[str], atoms: list[str]) -> bool:
    return len(parts) == len(atoms) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms))


def apply(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, Any]) -> None:
    """Split the modules of the plan over ``mesh`` (the tensor-parallel dimension), in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, dict(plan))
