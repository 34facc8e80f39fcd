"""Composer's metrics for language models and binary classification, as torchmetrics ``Metric``
objects whose states are summed over ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["BinaryF1Score", "LanguageCrossEntropy", "MaskedAccuracy", "LanguagePerplexity"]


class MaskedAccuracy(Metric):
    """The share of targets that ``preds.argmax(-1)`` gets right, leaving out targets equal to
    ``ignore_index`` (padding).

    Args:
        ignore_index: the target value to leave out.
        dist_sync_on_step: sum the states over ranks at every ``forward`` too.
    """

    full_state_update = False
    correct: Tensor
    total: Tensor

    def __init__(self, ignore_index: int = -100, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.ignore_index = ignore_index
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add one batch of scores ``(..., num_classes)`` and class indices ``(...)``."""
        predicted = preds.argmax(dim=-1)
        if predicted.shape != target.shape:
            raise ValueError(f"MaskedAccuracy needs scores of shape {tuple(target.shape)} + (num_classes,) "
                             f"for targets of shape {tuple(target.shape)}, got {tuple(preds.shape)}")
        kept = target != self.ignore_index
        self.correct += (predicted[kept] == target[kept]).sum()
        self.total += kept.sum()

    def compute(self) -> Tensor:
        """Correct predictions over counted targets, on every rank."""
        return self.correct.float() / self.total


class LanguageCrossEntropy(Metric):
    """Cross entropy per token over all tokens seen, leaving out targets equal to ``ignore_index``.

    ``update`` takes logits ``(..., vocab)``, or a mapping holding them under ``'logits'``, and
    targets ``(...)``.

    Args:
        dist_sync_on_step: sum the states over ranks at every ``forward`` too.
        ignore_index: the target value to leave out (padding, prompt tokens).
    """

    full_state_update = False
    sum_loss: Tensor
    total_items: Tensor

    def __init__(self, dist_sync_on_step: bool = False, ignore_index: int = -100) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.ignore_index = ignore_index
        self.loss_fn = torch.nn.CrossEntropyLoss(ignore_index=ignore_index, reduction="sum")
        self.add_state("sum_loss", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("total_items", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, output: Mapping[str, Any] | Tensor, target: Tensor) -> None:
        """Add the summed cross entropy and the number of counted tokens of one batch."""
        if isinstance(output, Mapping):
            logits = output["logits"]
        elif isinstance(output, Tensor):
            logits = output
        else:
            raise TypeError(f"{type(self).__name__} takes logits as a Tensor or a mapping with 'logits', "
                            f"not {type(output).__name__}")
        target = target.reshape(-1)
        self.sum_loss += self.loss_fn(logits.reshape(target.shape[0], -1), target)
        self.total_items += (target != self.ignore_index).sum()

    def compute(self) -> Tensor:
        """The mean cross entropy per counted token, over every rank."""
        return self.sum_loss / self.total_items


class LanguagePerplexity(LanguageCrossEntropy):
    """``exp`` of :class:`LanguageCrossEntropy`: the perplexity per counted token."""

    def compute(self) -> Tensor:
        """The perplexity per counted token, over every rank."""
        return torch.exp(super().compute())


class BinaryF1Score(Metric):
    """F1 score of the positive class (1), predicting ``output.argmax(1)``.

    Args:
        dist_sync_on_step: sum the states over ranks at every ``forward`` too.
    """

    full_state_update = False
    true_positive: Tensor
    false_positive: Tensor
    false_negative: Tensor

    def __init__(self, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        # the float and int counters are Composer's, kept so that states match a Composer checkpoint's
        self.add_state("true_positive", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("false_positive", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("false_negative", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, output: Tensor, target: Tensor) -> None:
        """Add one batch of two-class scores ``(N, 2)`` and 0/1 targets ``(N,)``."""
        predictions = torch.argmax(output, dim=1)
        on_positives = predictions[target == 1]
        self.true_positive += on_positives.sum()
        self.false_positive += (on_positives == 0).sum()
        self.false_negative += (predictions[target == 0] == 1).sum()

    def compute(self) -> Tensor:
        """2 TP / (2 TP + FP + FN), written as Composer writes it."""
        return self.true_positive / (self.true_positive + 0.5 * (self.false_negative + self.false_positive))
