"""State: everything the training loop reads and changes, shared with callbacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lockstep.time import Time, Timestamp, TimeUnit


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
    eval_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Composer's ``{label: {name: Metric}}``: each evaluator's metrics (torchmetrics objects;
    ``compute()`` gives the last evaluation's value), with lockstep's ``'loss'`` among them."""
    evaluators: list[Any] = field(default_factory=list)
    """The run's :class:`lockstep.core.Evaluator` objects, as Composer's ``state.evaluators``."""
    dataloader: Any = None
    """The dataloader being iterated: the training one during ``fit``, an evaluator's during its evaluation."""
    dataloader_label: str | None = None
    """The label of ``dataloader``: ``train_dataloader_label`` during ``fit``, the evaluator's label
    during its evaluation."""
    strategy: Any = None
    """The backend (:class:`lockstep.parallel.strategy.Strategy`): gradient clipping goes through it."""
    run_folder: str | None = None
    """The run's folder (``run_folder=`` or the launcher's run directory), where loggers put files."""
    profiler: Any = None
    """The run's :class:`lockstep.profiler.Profiler` (Composer's ``state.profiler``), or None."""
    batch: Any = None
    """This rank's current training batch (from BATCH_START to BATCH_END; the microbatch in the
    microbatch loop; the evaluation batch during evaluation)."""
    device_train_microbatch_size: int | None = None
    """The microbatch size in use (None: the whole batch); ``'auto'`` updates it as it searches."""
    outputs: Any = None
    """The model's outputs of the current microbatch (or evaluation batch), from AFTER_FORWARD on."""
    loss_tensor: torch.Tensor | None = None
    """This rank's mean training loss of the last batch (kept as a tensor: no device sync per step);
    in the microbatch loop, from AFTER_LOSS on, the microbatch's loss."""

    @property
    def loss(self) -> torch.Tensor | None:
        """As Composer's ``state.loss``: a tensor (``float(state.loss)`` reads it). A callback or
        algorithm may set it at AFTER_LOSS to change what is backpropagated."""
        return self.loss_tensor

    @loss.setter
    def loss(self, value: torch.Tensor) -> None:
        self.loss_tensor = value

    @property
    def lr(self) -> float:
        return float(self.optimizers[0].param_groups[0]["lr"]) if self.optimizers else float("nan")

    def stop_training(self) -> None:
        """End training after the current batch, as Composer's ``state.stop_training()``:
        ``max_duration`` becomes the number of batches done, which the loop checks after each batch
        (what runs after the batch, evaluation and checkpoints included, still runs). Call it on
        every rank (a decision the ranks agree on), or ranks stop at different batches."""
        self.max_duration = Time(int(self.timestamp.batch), TimeUnit.BATCH)
