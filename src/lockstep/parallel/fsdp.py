"""The FSDP backend: the model sharded in place by :func:`lockstep.parallel.fsdp_sharding.prepare_fsdp`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.parallel.fsdp_sharding import FSDPSetup, prepare_fsdp
from lockstep.parallel.fsdp_config import FSDPConfig
from lockstep.parallel.precision import NULL_CONTEXT
from lockstep.parallel.strategy import Strategy

if TYPE_CHECKING:
    from lockstep.checkpoint.layout import Layout


class FSDPStrategy(Strategy):
    """``fully_shard`` per the wrapping rules of ``fsdp_config``; the step calls the sharded model
    itself. Gradients are reduce-scattered in the last microbatch's backward only."""

    gathers_in_forward = True
    needs_process_group = True

    def __init__(self, device: torch.device, precision: str, config: FSDPConfig) -> None:
        super().__init__(device, precision)
        self.config = config
        self.fsdp = FSDPSetup()
        """The units and checkpointed modules :func:`prepare_fsdp` made."""

    def setup(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        model.to(self.device)
        self.fsdp = prepare_fsdp(model, self.config, self.precision, self.device, optimizers)
        self.model = self.module = model
        self.optimizers = optimizers

    def _compile_targets(self) -> list[nn.Module]:
        below_root = [u.module for u in self.fsdp.units if u.module is not self.model]
        return below_root or [self.model]

    def sync_context(self, is_last_microbatch: bool) -> contextlib.AbstractContextManager[Any]:
        self.model.set_requires_gradient_sync(is_last_microbatch)  # type: ignore[operator]
        return NULL_CONTEXT

    def layout(self) -> Layout:
        from lockstep.checkpoint.states import FullLayout, LocalLayout, ShardedLayout
        kinds = {"full": FullLayout, "local": LocalLayout, "sharded": ShardedLayout}
        return kinds[self.config.state_dict_type](self.model, self.optimizers, self.fsdp.buffer_dtypes)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "units": self.fsdp.units, "checkpointed": self.fsdp.checkpointed}
