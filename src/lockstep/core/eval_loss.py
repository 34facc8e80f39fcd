"""lockstep's ``'loss'`` eval metric: its own module, imported when an evaluation is set up, so that
importing the Trainer does not import torchmetrics."""

from __future__ import annotations

import torch
from torchmetrics import Metric

__all__ = ["EvalLoss"]


class EvalLoss(Metric):
    """The mean of the model's ``loss(outputs, batch)`` over the evaluated samples (each batch's
    loss weighted by its sample count), summed over the ranks when computed."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, num_samples: int) -> None:  # type: ignore[override]
        if not isinstance(loss, torch.Tensor):  # several losses: what training backpropagates
            from lockstep.model import total_loss
            loss = total_loss(loss)
        self.total += loss.detach().double() * num_samples
        self.count += num_samples

    def compute(self) -> torch.Tensor:
        return self.total / self.count if self.count > 0 else torch.tensor(float("nan"), dtype=torch.float64)
