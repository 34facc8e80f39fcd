"""``torch.compile`` after the model is wrapped: each module compiled in place, so parameter and
state dict names do not change, and a checkpoint of a compiled run loads into an eager one.

Under DDP the user's module's ``forward`` is compiled (DDP's gradient hooks stay outside the
graph); under FSDP each unit below the root is compiled on its own, as torchtitan compiles each
transformer block, with the unit's all-gathers left to FSDP's own (eager) hooks. The first dimension
of each compiled module's inputs is marked dynamic, so a short last batch (or another eval batch
size) does not compile again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lockstep.batch import map_tensors


def check_compile_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``compile_config`` as keyword arguments of ``torch.compile``, or a one-line error."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise TypeError(f"compile_config must be a dict of torch.compile arguments (or None), got "
                        f"{type(config).__name__}")
    import inspect

    allowed = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(f"compile_config has unknown keys {unknown}: use torch.compile's arguments "
                         f"({', '.join(sorted(allowed))})")
    return dict(config)


def compile_in_place(modules: list[nn.Module], config: dict[str, Any]) -> None:
    """Compile each module's ``forward``; its hooks (FSDP's gathers, DDP's) stay eager around it."""
    for module in modules:
        module.register_forward_pre_hook(_mark_inputs_dynamic)
        module.forward = torch.compile(module.forward, **config)  # type: ignore[method-assign]


def _mark_inputs_dynamic(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Mark dimension 0 of the inputs' tensors dynamic (a hint: a static size stays allowed)."""
    def mark(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return t

    map_tensors(args, mark)
