"""Composer's general metrics as torchmetrics ``Metric`` objects, whose states are summed over ranks:
cross entropy, any loss function averaged over batches, and segmentation's mIoU and Dice.

(No ``from __future__ import annotations`` here: TorchScript reads these classes' annotations,
and cannot resolve them as strings.)"""

from collections.abc import Callable

import torch
from torch import Tensor
from torchmetrics import Metric

from lockstep.loss.loss import soft_cross_entropy

__all__ = ["MIoU", "Dice", "CrossEntropy", "LossMetric"]


class _MeanOverBatches(Metric):
    """A loss averaged over batches: each batch weighs the same, whatever its size."""

    full_state_update = False
    sum_loss: Tensor
    total_batches: Tensor

    def __init__(self, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.add_state("sum_loss", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("total_batches", default=torch.tensor(0), dist_reduce_fx="sum")

    def _add(self, batch_loss: Tensor) -> None:
        self.sum_loss += batch_loss
        self.total_batches += 1

    def compute(self) -> Tensor:
        """The loss averaged over the batches seen on every rank."""
        return self.sum_loss / self.total_batches


class LossMetric(_MeanOverBatches):
    """The mean over batches of ``loss_function(preds, targets)``.

    Args:
        loss_function: returns the loss of one batch as a scalar tensor.
        dist_sync_on_step: sum the states over ranks at every ``forward`` too.
    """

    def __init__(self, loss_function: Callable[[Tensor, Tensor], Tensor], dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.loss_function = loss_function

    def update(self, preds: Tensor, targets: Tensor) -> None:
        """Add the loss of one batch."""
        self._add(self.loss_function(preds, targets))


class CrossEntropy(_MeanOverBatches):
    """The mean over batches of :func:`~lockstep.loss.soft_cross_entropy` (class indices or
    probabilities), leaving out targets equal to ``ignore_index``.

    Args:
        ignore_index: the target value to leave out (class indices only).
        dist_sync_on_step: sum the states over ranks at every ``forward`` too.
    """

    def __init__(self, ignore_index: int = -100, dist_sync_on_step: bool = False) -> None:
        super().__init__(dist_sync_on_step=dist_sync_on_step)
        self.ignore_index = ignore_index

    def update(self, preds: Tensor, targets: Tensor) -> None:
        """Add the mean cross entropy of one batch."""
        self._add(soft_cross_entropy(preds, targets, ignore_index=self.ignore_index))


class MIoU(Metric):
    """Mean intersection over union (in percent) of the predicted classes (``logits.argmax(1)``)
    and the target classes, over the classes that occur; pixels whose target is ``ignore_index``
    are left out. States are summed over ranks at every ``forward``.
    """

    full_state_update = False
    total_intersect: Tensor
    total_union: Tensor

    def __init__(self, num_classes: int, ignore_index: int = -1) -> None:
        super().__init__(dist_sync_on_step=True)
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.add_state("total_intersect", default=torch.zeros(num_classes, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_union", default=torch.zeros(num_classes, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: Tensor, targets: Tensor) -> None:
        """Add the pixel counts of one batch of ``(N, C, ...)`` logits and ``(N, ...)`` targets."""
        preds = logits.argmax(dim=1)
        kept = targets != self.ignore_index
        preds, targets = preds[kept], targets[kept]
        intersect = self._count(preds[preds == targets])
        self.total_intersect += intersect
        self.total_union += self._count(preds) + self._count(targets) - intersect

    def _count(self, classes: Tensor) -> Tensor:
        """How often each class occurs; values outside ``[0, num_classes)`` are not counted."""
        inside = classes[(classes >= 0) & (classes < self.num_classes)]
        return torch.bincount(inside.long(), minlength=self.num_classes).to(torch.float64)

    def compute(self) -> Tensor:
        """The mean IoU in percent over the classes seen in a prediction or a target."""
        seen = self.total_union != 0
        return 100 * (self.total_intersect[seen] / self.total_union[seen]).mean()


class Dice(Metric):
    """The Dice coefficient (in percent, rounded to 2 decimals) of each foreground class, averaged
    over batches and classes. ``preds`` are ``(N, num_classes + 1, ...)`` scores whose channel 0 is
    the background; states are summed over ranks at every ``forward``.
    """

    full_state_update = False
    n_updates: Tensor
    dice: Tensor

    def __init__(self, num_classes: int) -> None:
        super().__init__(dist_sync_on_step=True)
        self.add_state("n_updates", default=torch.zeros(1), dist_reduce_fx="sum")
        self.add_state("dice", default=torch.zeros((num_classes,)), dist_reduce_fx="sum")

    def update(self, preds: Tensor, targets: Tensor) -> None:
        """Add the per-class Dice scores of one batch."""
        self.n_updates += 1
        self.dice += self.compute_stats(preds, targets)

    def compute(self) -> float:
        """The mean Dice score in percent, rounded to 2 decimals."""
        return round(torch.mean(100 * self.dice / self.n_updates).item(), 2)

    @staticmethod
    def compute_stats(preds: Tensor, targets: Tensor) -> Tensor:
        """The Dice score of each class but the background (channel 0) in one batch; a class absent
        from the targets scores 1 if it is absent from the predictions too, else 0."""
        num_classes = preds.shape[1]
        predicted = preds.argmax(dim=1) if preds.ndim == targets.ndim + 1 else preds
        scores = torch.zeros(num_classes - 1, device=preds.device, dtype=torch.float32)
        for i in range(1, num_classes):
            is_target = targets == i
            if not is_target.any():
                scores[i - 1] += 1 if bool((preds.argmax(dim=1) != i).all()) else 0
                continue
            is_pred = predicted == i
            tp = (is_pred & is_target).sum()
            errors = (is_pred & ~is_target).sum() + (~is_pred & is_target).sum()
            scores[i - 1] += (2 * tp).float() / (2 * tp + errors).float()
        return scores
