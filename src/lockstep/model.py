"""``lockstep.Model``: the interface the Trainer drives."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep.batch import batch_num_samples, split_batch


class Model(nn.Module):
    """An ``nn.Module`` that knows how to compute its loss and metrics from a batch.

    Subclasses implement :meth:`forward` and :meth:`loss`; the rest have defaults:

    * ``eval_forward(batch, outputs=None)`` returns the outputs metrics are computed on;
    * ``get_metrics(is_train=False)`` returns a dict of torchmetrics ``Metric`` objects, updated by
      ``update_metric(batch, outputs, metric)`` (default: ``metric.update(outputs, batch[1])`` for
      an ``(inputs, targets)`` batch);
    * ``split_batch`` / ``num_samples`` / ``num_tokens`` teach the Trainer a batch type other than a
      tensor, a tuple or list, or a dict of tensors (``num_tokens`` counts 0 unless overridden).

    ``loss`` must return the *mean* loss over the samples of the batch it is given: the Trainer
    weighs each microbatch by its share of the global batch.
    """

    def forward(self, batch: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement forward(batch)")

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement loss(outputs, batch)")

    def eval_forward(self, batch: Any, outputs: Any = None) -> Any:
        return outputs if outputs is not None else self(batch)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {}

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        metric.update(outputs, batch[1])

    def split_batch(self, batch: Any, microbatch_size: int) -> list[Any]:
        return split_batch(batch, microbatch_size)

    def num_samples(self, batch: Any) -> int:
        return batch_num_samples(batch)

    def num_tokens(self, batch: Any) -> int:
        return 0


def total_loss(loss: Any) -> torch.Tensor:
    """What is backpropagated when ``model.loss`` returns several losses, as in Composer: a dict's
    ``'total'`` entry, else the sum of its values; the sum of a tuple's or list's."""
    if isinstance(loss, dict):
        return loss["total"] if "total" in loss else sum(loss.values())  # type: ignore[return-value]
    if isinstance(loss, (tuple, list)):
        return sum(loss)  # type: ignore[return-value]
    raise TypeError(f"model.loss returned a {type(loss).__name__}: return a tensor, or a dict or tuple of tensors")
