"""Training metrics, as Composer keeps them: the model's ``get_metrics(is_train=True)`` (held in
``state.train_metrics``) are reset before each batch, updated after each microbatch's backward
with ``eval_forward(batch, outputs)`` (which, given the outputs, runs no second forward for
Composer's models), and computed over all ranks and logged as ``metrics/train/<name>`` when the
batch ends. A model without training metrics (lockstep's default) costs nothing here."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lockstep.elastic.collectives import gather_metrics_through_lockstep
from lockstep.core.state import State
from lockstep.utils.misc import model_eval_mode


def build(state: State) -> None:
    """Give ``state`` its own copies of the model's training metrics, on its device."""
    model = state.model
    metrics = model.get_metrics(is_train=True) if hasattr(model, "get_metrics") else {}
    device = state.device.torch_device
    state.train_metrics = {name: copy.deepcopy(metric).to(device) for name, metric in (metrics or {}).items()}
    gather_metrics_through_lockstep(state.train_metrics.values())


def reset(state: State) -> None:
    for metric in state.train_metrics.values():  # type: ignore[union-attr]
        metric.reset()


def update(state: State, batch: Any, outputs: Any) -> None:
    """Update every training metric with one microbatch's ``outputs`` (in eval mode, no gradients);
    outputs a callback freed (``FreeOutputs``: an empty tensor) update nothing."""
    if outputs is None or isinstance(outputs, torch.Tensor) and outputs.numel() == 0:
        return
    model = state.model
    with torch.no_grad(), model_eval_mode(model):
        eval_outputs = model.eval_forward(batch, outputs)
        for metric in state.train_metrics.values():  # type: ignore[union-attr]
            model.update_metric(batch, eval_outputs, metric)


def compute(state: State) -> dict[str, Any]:
    """Compute each metric over all ranks (a collective) and keep its value; what to log, as
    ``{'metrics/train/<name>': value}``."""
    values = {name: metric.compute() for name, metric in state.train_metrics.items()}  # type: ignore[union-attr]
    state.train_metric_values.update(values)
    return {f"metrics/train/{name}": value for name, value in values.items()}
