"""``ComposerClassifier``: a classification model from any ``nn.Module`` that maps inputs to logits."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from lockstep.loss.loss import soft_cross_entropy
from lockstep.metrics.metrics import CrossEntropy
from lockstep.model import Model

__all__ = ["ComposerClassifier"]


class ComposerClassifier(Model):
    """Wraps ``module`` into a model that trains on ``(input, target)`` batches.

    Args:
        module: maps a batch of inputs to logits ``(N, num_classes, ...)``.
        num_classes: the number of classes; ``module.num_classes``, where it exists, takes precedence
            (with a warning if the two differ). Needed unless both metric arguments are given.
        train_metrics: a ``Metric`` or ``MetricCollection`` for training (default:
            ``MulticlassAccuracy(num_classes, average='micro')``).
        val_metrics: the same for evaluation (default: :class:`~lockstep.metrics.CrossEntropy` and
            ``MulticlassAccuracy``).
        loss_fn: ``loss_fn(outputs, targets, *args, **kwargs)`` returns the mean loss of a batch.

    :meth:`get_metrics` names a single metric by its class name and a collection's metrics by
    their keys in the collection (``'CrossEntropy'``, ``'MulticlassAccuracy'`` by default).
    """

    def __init__(self, module: torch.nn.Module, num_classes: int | None = None,
                 train_metrics: Metric | MetricCollection | None = None,
                 val_metrics: Metric | MetricCollection | None = None,
                 loss_fn: Callable[..., Tensor] = soft_cross_entropy) -> None:
        super().__init__()
        self.module = module
        self._loss_fn = loss_fn
        self.num_classes = num_classes = _num_classes(module, num_classes)
        if train_metrics is None or val_metrics is None:
            if num_classes is None:
                raise ValueError("ComposerClassifier needs the number of classes: pass num_classes=..., give the "
                                 "module a num_classes attribute, or pass both train_metrics and val_metrics")
            if train_metrics is None:
                train_metrics = MulticlassAccuracy(num_classes=num_classes, average="micro")
            if val_metrics is None:
                val_metrics = MetricCollection([CrossEntropy(),
                                                MulticlassAccuracy(num_classes=num_classes, average="micro")])
        self.train_metrics = train_metrics
        self.val_metrics = val_metrics

    def forward(self, batch: tuple[Tensor, Any]) -> Tensor:
        inputs, _ = batch
        return self.module(inputs)

    def loss(self, outputs: Tensor, batch: tuple[Any, Tensor], *args: Any, **kwargs: Any) -> Tensor:
        _, targets = batch
        return self._loss_fn(outputs, targets, *args, **kwargs)

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        metrics = self.train_metrics if is_train else self.val_metrics
        if isinstance(metrics, Metric):
            return {type(metrics).__name__: metrics}
        return dict(metrics.items())

    def update_metric(self, batch: Any, outputs: Any, metric: Metric) -> None:
        _, targets = batch
        metric.update(outputs, targets)


def _num_classes(module: torch.nn.Module, num_classes: int | None) -> int | None:
    """``module.num_classes`` where it exists, else ``num_classes``."""
    if not hasattr(module, "num_classes"):
        return num_classes
    from_module = getattr(module, "num_classes")
    if num_classes is not None and num_classes != from_module:
        warnings.warn(f"ComposerClassifier was given num_classes={num_classes} but the module has "
                      f"num_classes={from_module}; using the module's")
    return from_module
