"""NaNMonitor: fail the run as soon as the training loss is NaN."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["NaNMonitor"]


class NaNMonitor(Callback):
    """At AFTER_LOSS of every microbatch, raise ``RuntimeError('Train loss contains a NaN.')`` when
    the loss (a tensor, a sequence of them, or a dict: ``'Train loss <key> contains a NaN.'``) has a
    NaN. Infinities pass, as in Composer. Reading the loss costs a device sync per microbatch.

    Only the rank that sees the NaN raises, as in Composer; the launcher then stops the others.
    """

    def after_loss(self, state: State, logger: Logger) -> None:
        loss = state.loss
        if isinstance(loss, torch.Tensor):
            _check(loss, "Train loss contains a NaN.")
        elif isinstance(loss, Mapping):
            for key, value in loss.items():
                _check(value, f"Train loss {key} contains a NaN.")
        elif isinstance(loss, Sequence):
            for value in loss:
                _check(value, "Train loss contains a NaN.")
        else:
            raise TypeError(f"NaNMonitor: the loss is a {type(loss).__name__}; return a tensor, a sequence "
                            f"or a dict of tensors from the model's loss()")


def _check(loss: torch.Tensor, message: str) -> None:
    if bool(torch.isnan(loss).any()):
        raise RuntimeError(message)
