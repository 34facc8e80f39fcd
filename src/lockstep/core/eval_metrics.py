"""``state.eval_metrics`` as Composer has it, ``{label: {name: Metric}}``, and what lockstep adds:
each evaluator's ``'loss'`` (the model's loss over the evaluated samples), and the metrics' values
as plain numbers for logs and checkpoints."""

from __future__ import annotations

from typing import Any

import sys

import torch

__all__ = ["values", "value_of", "restore_values"]

LOSS = "loss"
"""The name of lockstep's own eval metric in each evaluator's metrics (:mod:`lockstep.core.eval_loss`)."""


def is_metric(obj: Any) -> bool:
    """Whether ``obj`` is a torchmetrics ``Metric``, without importing torchmetrics: with
    ``transformers`` installed, that import takes over a second, and no Metric exists before it."""
    module = sys.modules.get("torchmetrics")
    return module is not None and isinstance(obj, module.Metric)



def values(eval_metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{label: {name: value}}`` of the metrics' last computed values (a plain number stays one).
    A metric not computed since its last update or reset (an evaluator that has not run yet) is
    left out: computing it would gather over the ranks, and this may run on one rank only."""
    return {label: {name: value_of(metric) for name, metric in metrics.items()
                    if not is_metric(metric) or metric._computed is not None}
            for label, metrics in eval_metrics.items()}


def value_of(metric: Any) -> float:
    """A metric's value as a float: a Metric's ``compute()`` (cached after an evaluation, so no
    collective), or the number itself."""
    value = metric.compute() if is_metric(metric) else metric
    return float(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)


def restore_values(eval_metrics: dict[str, dict[str, Any]], saved: dict[str, Any]) -> None:
    """Put saved values back: ``compute()`` of each live metric named in ``saved`` returns its
    saved value until the next evaluation resets it. A checkpoint of an older lockstep saved one
    flat ``{name: value}``: it is the ``'eval'`` evaluator's."""
    if saved and not all(isinstance(v, dict) for v in saved.values()):
        saved = {"eval": saved}
    for label, named in saved.items():
        live = eval_metrics.get(label, {})
        for name, value in named.items():
            metric = live.get(name)
            if is_metric(metric):
                metric._computed = torch.tensor(float(value), dtype=_float_dtype(metric))
                metric._update_count = max(metric._update_count, 1)  # no "compute before update" warning


def _float_dtype(metric: Any) -> torch.dtype:
    """The dtype a metric computes in, as its floating-point states tell (float32 without one)."""
    for name in getattr(metric, "_defaults", {}):
        state = getattr(metric, name, None)
        if isinstance(state, torch.Tensor) and state.is_floating_point():
            return state.dtype
    return torch.float32
