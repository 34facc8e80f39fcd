"""ActivationMonitor: statistics of every module's inputs and outputs, every ``interval`` of training
(Composer's ``ActivationMonitor``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lockstep.core.callback import Callback
from lockstep.time import Time, TimeUnit

__all__ = ["ActivationMonitor"]


class ActivationMonitor(Callback):
    """Log, for every module, the mean over the last dimension's ``max``, ``average``, ``l2_norm``
    and ``kurtosis`` of each input and output tensor, as
    ``activations/<stat>/<module name>_input.<i>`` and ``..._output.<i>``, on the first forward of
    every ``interval`` (``'25ba'``; ``ba`` or ``ep``). Forward hooks are attached for that forward
    only. Modules whose name contains one of ``ignore_module_types`` are skipped. With
    ``only_log_wandb`` (the default) the statistics go to the W&B destinations when there are
    some, else to every destination."""

    def __init__(self, interval: int | str | Time = "25ba", ignore_module_types: list[str] | None = None,
                 only_log_wandb: bool = True) -> None:
        self.interval = Time.from_input(interval, TimeUnit.BATCH)
        if self.interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH):
            raise ValueError(f"ActivationMonitor(interval='{self.interval}'): give it in ba or ep")
        if self.interval.unit is TimeUnit.BATCH and self.interval.value < 10:
            warnings.warn(f"ActivationMonitor(interval='{self.interval}'): hooks on every module slow the step; "
                          f"an interval of at least 10ba is recommended", stacklevel=2)
        self.ignore_module_types = ignore_module_types
        self.only_log_wandb = only_log_wandb
        self.handles: list[Any] = []
        self.module_names: dict[nn.Module, str] = {}
        self.last_train_time_value_logged = -1

    def _due(self, state: Any) -> bool:
        now = state.timestamp.get(self.interval.unit).value
        return now % self.interval.value == 0 and now != self.last_train_time_value_logged

    def before_forward(self, state: Any, logger: Any) -> None:
        if not self._due(state):
            return
        if not self.module_names:
            self.module_names = {m: name or type(m).__name__ for name, m in state.model.named_modules()}
        step = state.timestamp.batch.value
        for module in state.model.modules():
            self.handles.append(module.register_forward_hook(
                lambda mod, inputs, outputs: self._log(logger, step, mod, inputs, outputs)))

    def after_forward(self, state: Any, logger: Any) -> None:
        if self._due(state):
            self.last_train_time_value_logged = state.timestamp.get(self.interval.unit).value
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _log(self, logger: Any, step: int, module: nn.Module, inputs: Any, outputs: Any) -> None:
        name = self.module_names.get(module, type(module).__name__)
        if self.ignore_module_types and any(ignored in name for ignored in self.ignore_module_types):
            return
        metrics: dict[str, float] = {}
        for kind, values in (("input", inputs), ("output", outputs)):
            items = values if isinstance(values, (list, tuple)) else [values]
            for i, value in enumerate(items):
                for suffix, tensor in _tensors(value, f"_{kind}.{i}"):
                    metrics.update(_statistics(f"{name}{suffix}", tensor))
        if not metrics:
            return
        destinations = [d for d in logger.destinations if type(d).__name__ == "WandBLogger"]
        if self.only_log_wandb and destinations:
            for destination in destinations:
                destination.log_metrics(metrics, step)
        else:
            logger.log_metrics(metrics)

    def close(self, state: Any, logger: Any) -> None:
        self._remove_hooks()


def _tensors(value: Any, suffix: str) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield suffix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{suffix}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{suffix}.{key}")


def _statistics(name: str, tensor: torch.Tensor) -> dict[str, float]:
    """Mean over rows of each row's max, mean, L2 norm and kurtosis (rows: all but the last dimension)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return {}
    with torch.no_grad():
        rows = tensor.detach().float().reshape(-1, tensor.shape[-1] if tensor.dim() else 1)
        mean = rows.mean(dim=-1, keepdim=True)
        centred = rows - mean
        variance = centred.pow(2).mean(dim=-1)
        kurtosis = centred.pow(4).mean(dim=-1) / variance.pow(2).clamp_min(1e-12)
        return {f"activations/max/{name}": float(rows.max(dim=-1).values.mean()),
                f"activations/average/{name}": float(mean.mean()),
                f"activations/l2_norm/{name}": float(rows.norm(dim=-1).mean()),
                f"activations/kurtosis/{name}": float(kurtosis.mean())}
