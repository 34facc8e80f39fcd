"""A torch scheduler built on an optimizer the Trainer does not train with is a one-line error
(issue 49): it was accepted, and training went on without its schedule."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, StepLR

from lockstep import Trainer
from tests.trainer.common import MLP, error_of, loader


def _trainer(model: MLP, optimizers, **kwargs) -> Trainer:
    return Trainer(model=model, train_dataloader=loader(4), optimizers=optimizers, device="cpu",
                   progress_bar=False, max_duration="2ba", **kwargs)


def _other() -> torch.optim.Optimizer:
    return torch.optim.SGD(MLP().parameters(), lr=0.1)


@pytest.mark.parametrize("where", ["Trainer", "fit"])
def test_a_scheduler_of_another_optimizer_is_refused_naming_it(where: str) -> None:
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    stray = StepLR(_other(), 1)
    if where == "Trainer":
        error = error_of(_trainer, model, optimizer, schedulers=[stray], expected=(ValueError,))
    else:
        trainer = _trainer(model, optimizer)
        error = error_of(trainer.fit, schedulers=[stray], expected=(ValueError,))
        assert trainer.state.schedulers == [] and trainer.state.timestamp.batch == 0  # nothing changed
    assert error.startswith("schedulers[0] (StepLR) steps a SGD that is not one of the Trainer's optimizers "
                            "(AdamW)") and "\n" not in error, error


def test_schedulers_of_the_trainers_optimizers_are_taken() -> None:
    model = MLP()
    first = torch.optim.AdamW(model.net[0].parameters(), lr=0.01)
    second = torch.optim.SGD(model.net[2].parameters(), lr=0.1)
    trainer = _trainer(model, [first, second], schedulers=[StepLR(first, 1), LambdaLR(second, lambda e: 0.5)])
    assert len(trainer.state.schedulers) == 2
    later = StepLR(second, 1, gamma=0.5)
    trainer.fit(schedulers=later, step_schedulers_every_batch=True)
    assert trainer.state.schedulers == [later] and second.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 2)
