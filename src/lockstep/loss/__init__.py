"""Composer's loss functions at Composer's ``composer.loss`` path."""

from lockstep.loss.loss import DiceLoss, binary_cross_entropy_with_logits, loss_registry, soft_cross_entropy

__all__ = ["DiceLoss", "binary_cross_entropy_with_logits", "loss_registry", "soft_cross_entropy"]
