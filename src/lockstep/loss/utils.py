"""Telling class-index targets from one-hot (or soft) targets, and turning the first into the second."""

from __future__ import annotations

import warnings

import torch

__all__ = ["infer_target_type", "ensure_targets_one_hot", "check_for_index_targets"]

_INDEX_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def infer_target_type(input: torch.Tensor, targets: torch.Tensor) -> str:
    """``'one_hot'`` if ``targets`` has the shape of ``input`` (class probabilities), ``'indices'``
    if it has one dimension less (class indices); RuntimeError otherwise."""
    if input.shape == targets.shape:
        return "one_hot"
    if input.ndim == targets.ndim + 1:
        return "indices"
    raise RuntimeError(f"targets of shape {tuple(targets.shape)} fit neither input of shape {tuple(input.shape)} "
                       "as class probabilities (same shape) nor as class indices (one dimension less)")


def check_for_index_targets(targets: torch.Tensor) -> bool:
    """Whether ``targets`` has an integer dtype, as class indices do."""
    return targets.dtype in _INDEX_DTYPES


def ensure_targets_one_hot(input: torch.Tensor, targets: torch.Tensor,
                           num_classes: int | None = None) -> torch.Tensor:
    """``targets`` as float32 class probabilities shaped like ``input`` (classes in dimension 1).

    Class indices become one-hot rows over ``num_classes`` (default ``input.shape[1]``); a negative
    index becomes a row of zeros, with a warning.
    """
    if infer_target_type(input, targets) == "indices":
        targets = _one_hot(targets, input.shape[1] if num_classes is None else num_classes)
    return targets.float()


def _one_hot(indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """One-hot rows in a new dimension 1, in the dtype of ``indices``; negative indices give zeros."""
    if not check_for_index_targets(indices):
        raise ValueError(f"class-index targets must have an integer dtype, not {indices.dtype}")
    largest = int(indices.max())
    if num_classes <= largest:
        raise ValueError(f"num_classes must be greater than the largest target index: {num_classes} <= {largest}")
    negative = bool(indices.min() < 0)
    if negative:
        warnings.warn("Negative label indices are being ignored in conversion to one-hot labels")
        # an extra class collects the negative indices and is then cut off
        indices = torch.where(indices < 0, num_classes, indices.long())
    width = num_classes + 1 if negative else num_classes
    shape = (indices.shape[0], width, *indices.shape[1:])
    one_hot = torch.zeros(shape, dtype=indices.dtype, device=indices.device)
    one_hot.scatter_(1, indices.unsqueeze(1), 1)
    return one_hot[:, :num_classes] if negative else one_hot
