"""State: everything the training loop reads and changes, shared with callbacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lockstep.time import Time, Timestamp


@dataclass(kw_only=True, slots=True)
class State:
    """The Trainer's live state, shared with callbacks. ``model`` is the user's module (sharded in
    place under FSDP); the module the training step calls is the Trainer's ``strategy.module``."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    max_duration: Time | None
    run_name: str
    device: torch.device
    precision: str
    scaler: torch.amp.GradScaler | None = None
    """The loss scaler of ``amp_fp16`` (None otherwise, and under DeepSpeed, which scales itself)."""
    timestamp: Timestamp = field(default_factory=Timestamp)
    batches_per_epoch: int | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    strategy: Any = None
    """The backend (:class:`lockstep.parallel.strategy.Strategy`): gradient clipping goes through it."""
    run_folder: str | None = None
    """The run's folder (``run_folder=`` or the launcher's run directory), where loggers put files."""
    batch: Any = None
    """This rank's current training batch (from BATCH_START to BATCH_END)."""
    loss_tensor: torch.Tensor | None = None
    """This rank's mean training loss of the last batch (kept as a tensor: no device sync per step)."""

    @property
    def loss(self) -> float:
        return float("nan") if self.loss_tensor is None else float(self.loss_tensor)

    @property
    def lr(self) -> float:
        return float(self.optimizers[0].param_groups[0]["lr"]) if self.optimizers else float("nan")
