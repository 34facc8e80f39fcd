"""``fit(duration=...)`` errors name the argument (issue 49): ``fit(duration=-1)`` said only
"durations cannot be negative"."""

from __future__ import annotations

import pytest
import torch

from lockstep import Trainer
from lockstep.time import time_argument
from tests.trainer.common import MLP, error_of, loader


@pytest.mark.parametrize(("duration", "start"), [(-1, "duration=-1: "), ("-1ba", "duration='-1ba': "),
                                                 (0, "duration must be positive"), ("0.5dur", "duration cannot be")])
def test_fit_duration_errors_name_the_argument(duration, start: str) -> None:
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters()),
                      device="cpu", progress_bar=False, max_duration="2ba")
    error = error_of(trainer.fit, duration=duration, expected=(ValueError,))
    assert error.startswith(start) and "\n" not in error, error
    assert trainer.state.timestamp.batch == 0


def test_a_message_that_names_the_argument_is_not_named_twice() -> None:
    with pytest.raises(ValueError, match=r"^max_duration must be positive, got '0ep'$"):
        time_argument("max_duration", 0)
    with pytest.raises(ValueError, match=r"^max_duration=-3: durations cannot be negative$"):
        time_argument("max_duration", -3)
