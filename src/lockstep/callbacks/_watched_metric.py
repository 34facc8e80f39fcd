"""What the stopping callbacks share: reading the watched metric, and the comparison to apply to it.

Evaluation results are in ``state.eval_metrics`` as Composer keeps them, ``{label: {name: Metric}}``
(each evaluator's metrics and lockstep's ``'loss'``). The training side (label ``'train'``) is one
of the model's training metrics (``state.train_metrics``), or the training loss, ``'loss'``,
averaged over the ranks so that every rank takes the same decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lockstep import dist

if TYPE_CHECKING:
    from lockstep.state import State

Comparison = Callable[[Any, Any], Any]

TRAIN_LOSS_NAMES = ("loss", "loss/train/total")
"""What ``monitor`` may be with ``dataloader_label='train'``: the training loss."""


def comparison(comp: str | Comparison | None, monitor: str, owner: str) -> Comparison:
    """Composer's rule: ``comp`` as given, ``'gt'``/``'greater'`` or ``'lt'``/``'less'``; by default
    ``torch.less`` when the name says lower is better (loss, error, perplexity), else ``torch.greater``."""
    if callable(comp):
        return comp
    if isinstance(comp, str):
        named = {"greater": torch.greater, "gt": torch.greater, "less": torch.less, "lt": torch.less}
        if comp.lower() not in named:
            raise ValueError(f"{owner}(comp={comp!r}): use 'gt', 'greater', 'lt', 'less' "
                             f"or a callable comp(current, best)")
        return named[comp.lower()]
    if comp is not None:
        raise TypeError(f"{owner}(comp=...) must be a string or a callable comp(current, best), "
                        f"got {type(comp).__name__}")
    lower_is_better = any(word in monitor.lower() for word in ("loss", "error", "perplexity"))
    return torch.less if lower_is_better else torch.greater


def evaluated_label(state: State) -> str:
    """The label of the dataloader whose evaluation just ended (at EVAL_END)."""
    return getattr(state, "dataloader_label", None) or "eval"


def watched_value(state: State, monitor: str, dataloader_label: str, owner: str) -> torch.Tensor:
    """The current value of ``monitor`` for ``dataloader_label``, as a tensor (the same on every rank)."""
    if dataloader_label == "train":
        return _train_value(state, monitor, owner)
    metrics: Any = state.eval_metrics.get(dataloader_label, {})
    if monitor not in metrics:
        known = ", ".join(sorted(map(str, metrics))) or "none yet"
        raise ValueError(f"{owner}: no metric {monitor!r} for dataloader_label {dataloader_label!r} (there: {known}); "
                         f"use 'eval' with one of the model's eval metric names, or 'train' with 'loss'")
    return _as_tensor(metrics[monitor])


def _train_value(state: State, monitor: str, owner: str) -> torch.Tensor:
    train_metrics = getattr(state, "train_metrics", None)
    if train_metrics and monitor in train_metrics:
        return _as_tensor(train_metrics[monitor])
    if monitor not in TRAIN_LOSS_NAMES:
        raise ValueError(f"{owner}: dataloader_label 'train' watches the training loss: set monitor='loss' "
                         f"(got {monitor!r}, which is not one of the model's training metrics), or watch an eval "
                         f"metric with dataloader_label='eval'")
    if state.loss is None:
        raise ValueError(f"{owner}: there is no training loss yet to watch")
    loss = state.loss.detach().float().reshape(()).clone()
    dist.all_reduce(loss, "SUM")  # each rank's loss is its own share: ranks must decide alike
    return (loss / dist.get_world_size()).cpu()


def _as_tensor(value: Any) -> torch.Tensor:
    if hasattr(value, "compute"):  # a torchmetrics Metric
        value = value.compute()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
