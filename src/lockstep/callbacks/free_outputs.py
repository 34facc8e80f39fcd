"""FreeOutputs: let go of the model's outputs once the loss is computed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lockstep.core.callback import Callback

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.state import State

__all__ = ["FreeOutputs"]


class FreeOutputs(Callback):
    """At AFTER_LOSS of every microbatch, replace ``state.outputs`` with an empty tensor, so that the
    outputs (logits of a large vocabulary, say) are freed before the backward unless autograd still
    needs them. Use it when nothing after the loss reads the outputs."""

    def after_loss(self, state: State, logger: Logger) -> None:
        state.outputs = torch.Tensor()
