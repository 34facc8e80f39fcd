"""Composer's loss functions: cross entropy and binary cross entropy that take class indices or
class probabilities alike, and a Dice loss for segmentation."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.modules.loss import _Loss

from lockstep.loss.utils import ensure_targets_one_hot, infer_target_type

__all__ = ["DiceLoss", "binary_cross_entropy_with_logits", "loss_registry", "soft_cross_entropy"]

_REDUCTIONS = ("none", "mean", "sum")


def soft_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
                       reduction: str = "mean") -> Tensor:
    """``F.cross_entropy`` for class indices; for class probabilities (``target`` shaped like
    ``input``), the cross entropy summed over classes with ``weight`` per class.

    With probabilities and ``reduction='mean'`` the sum is divided by the total target probability
    rather than the number of examples, so an all-zero row counts as an ignored example.
    ``ignore_index`` applies to class indices only.
    """
    if infer_target_type(input, target) == "indices":
        return F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index, reduction=reduction)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, not {reduction!r}")
    if ignore_index != -100:
        warnings.warn("ignore_index not supported when using dense labels. Ignoring targets with 0 probability.")
    per_class = -(target * F.log_softmax(input, dim=1))
    if weight is not None:
        per_class = (per_class.movedim(1, -1) * weight).movedim(-1, 1)
    per_example = per_class.sum(dim=1)
    if reduction == "none":
        return per_example
    if reduction == "sum":
        return per_example.sum()
    return _mean_over_probability(per_example, target)


def _mean_over_probability(per_example: Tensor, target: Tensor) -> Tensor:
    total_probability = target.sum()
    if total_probability <= 0:
        raise ValueError("No targets have nonzero probability: give at least one example a target that sums to 1")
    if total_probability < per_example.numel():
        warnings.warn("Some targets have less than 1 total probability.")
    return per_example.mean() * (per_example.numel() / total_probability)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None,
                                     reduction: str = "sum", pos_weight: Tensor | None = None,
                                     scale_by_batch_size: bool | None = True) -> Tensor:
    """``F.binary_cross_entropy_with_logits`` that also takes class indices (made one-hot), summed
    by default and divided by the batch size (``input.shape[0]``), which keeps the loss on the
    scale of a per-example loss rather than a per-element one."""
    bce = F.binary_cross_entropy_with_logits(input, ensure_targets_one_hot(input, target), weight=weight,
                                             reduction=reduction, pos_weight=pos_weight)
    return bce / input.shape[0] if scale_by_batch_size else bce


class DiceLoss(_Loss):
    """One minus the Dice coefficient of ``input`` and ``target`` (classes in dimension 1), as MONAI's.

    Args:
        sigmoid: apply a sigmoid to ``input`` first.
        softmax: apply a softmax over the classes to ``input`` first (not with ``sigmoid``).
        squared_pred: square input and target in the denominator.
        jaccard: the Jaccard index (soft IoU) instead of Dice.
        batch: sum over the batch before dividing, rather than one value per example.
        ignore_absent_classes: leave out classes absent from the target.
        reduction: ``'mean'``, ``'sum'`` or ``'none'`` over examples and classes.
    """

    def __init__(self, sigmoid: bool = False, softmax: bool = False, squared_pred: bool = False,
                 jaccard: bool = False, batch: bool = False, ignore_absent_classes: bool = False,
                 reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        if sigmoid and softmax:
            raise ValueError("DiceLoss takes sigmoid=True or softmax=True, not both")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, not {reduction!r}")
        self.sigmoid, self.softmax, self.squared_pred = sigmoid, softmax, squared_pred
        self.jaccard, self.batch, self.ignore_absent_classes = jaccard, batch, ignore_absent_classes

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        target = ensure_targets_one_hot(input, target)
        has_target = target.sum(dim=1, keepdim=True) != 0  # pixels without any class are left out
        if input.shape != target.shape:
            raise ValueError(f"target of shape {tuple(target.shape)} does not match input {tuple(input.shape)}")
        input = self._activate(input)
        dims = ([0] if self.batch else []) + list(range(2, input.ndim))
        intersection = torch.sum(target * input, dim=dims)
        if self.squared_pred:
            target, input = target ** 2, input ** 2
        target_area = torch.sum(target, dim=dims)
        union = target_area + torch.sum(has_target * input, dim=dims)
        if self.jaccard:
            union = 2.0 * (union - intersection)
        epsilon = 1e-5
        losses = 1.0 - (2.0 * intersection + epsilon) / (union + epsilon)
        if self.ignore_absent_classes:
            losses = losses[target_area > 0] if self.batch else losses[:, target_area.sum(dim=0) > 0]
        if self.reduction == "mean":
            return losses.mean()
        return losses.sum() if self.reduction == "sum" else losses

    def _activate(self, input: Tensor) -> Tensor:
        if self.sigmoid:
            return torch.sigmoid(input)
        if self.softmax:
            if input.shape[1] == 1:
                warnings.warn("single channel prediction, `softmax=True` ignored.")
                return input
            return torch.softmax(input, 1)
        return input


loss_registry = {
    "binary_cross_entropy_with_logits": binary_cross_entropy_with_logits,
    "soft_cross_entropy": soft_cross_entropy,
}
