"""Schedules of training time: Composer's formulas as a table, and the lr the Trainer applies to
each batch (the schedule's value at the timestamp before that batch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from lockstep import Callback, Trainer
from lockstep.optim import (
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    CosineAnnealingWithWarmupScheduler,
    ExponentialScheduler,
    LinearScheduler,
    LinearWithWarmupScheduler,
    MultiStepScheduler,
    MultiStepWithWarmupScheduler,
    PolynomialScheduler,
    PolynomialWithWarmupScheduler,
    ScheduledLR,
    StepScheduler,
)
from lockstep.optim.stepper import scale_torch_scheduler
from lockstep.time import Time, Timestamp
from tests.trainer.common import MLP, error_of, loader


@dataclass
class FakeState:
    timestamp: Timestamp
    max_duration: Time
    batches_per_epoch: int | None = 10
    optimizers: tuple = ()


def at(batch: int = 0, sample: int = 0, token: int = 0, max_duration: str = "100ba", per_epoch: int | None = 10):
    return FakeState(Timestamp(batch=batch, sample=sample, token=token), Time.from_string(max_duration), per_epoch)


def cos(frac: float, low: float = 0.0) -> float:
    return low + (1 - low) * (1 + math.cos(math.pi * frac)) / 2


CASES = [
    # (schedule, state, ssr, expected multiplier)
    (StepScheduler("10ba", gamma=0.5), at(25), 1.0, 0.25),
    (StepScheduler("1ep", gamma=0.5), at(25), 1.0, 0.25),  # 1ep = 10 batches
    (StepScheduler("10ba", gamma=0.5), at(25), 2.0, 0.5),  # stretched to 20ba
    (MultiStepScheduler(["10ba", "30ba"], gamma=0.1), at(29), 1.0, 0.1),
    (MultiStepScheduler(["10ba", "30ba"], gamma=0.1), at(30), 1.0, pytest.approx(0.01)),
    (ConstantScheduler(alpha=0.3, t_max="5ba"), at(4), 1.0, 0.3),
    (ConstantScheduler(alpha=0.3, t_max="5ba"), at(5), 1.0, 1.0),
    (LinearScheduler(alpha_i=1.0, alpha_f=0.2), at(25), 1.0, 1.0 + 0.25 * (0.2 - 1.0)),  # t_max 1dur = 100ba
    (LinearScheduler(alpha_i=1.0, alpha_f=0.2, t_max="50ba"), at(80), 1.0, 0.2),  # clipped at t_max
    (LinearScheduler(t_max="0.5dur"), at(sample=300, max_duration="1000sp"), 1.0, 0.4),
    (LinearScheduler(t_max="1dur"), at(15, max_duration="2ep"), 1.0, 0.25),  # 2ep = 20 batches
    (ExponentialScheduler(gamma=0.5, decay_period="10ba"), at(15), 1.0, 0.5 ** 1.5),
    (CosineAnnealingScheduler(alpha_f=0.1), at(30), 1.0, cos(0.3, 0.1)),
    (CosineAnnealingScheduler(t_max="2e4tok"), at(token=5000, max_duration="1e5tok"), 1.0, cos(0.25)),
    (CosineAnnealingScheduler(t_max="40ba"), at(30), 2.0, cos(30 / 80)),
    (CosineAnnealingWarmRestartsScheduler("10ba", t_mult=2.0), at(5), 1.0, cos(0.5)),
    (CosineAnnealingWarmRestartsScheduler("10ba", t_mult=2.0), at(15), 1.0, cos(5 / 20)),  # 2nd cycle: 10..30
    (CosineAnnealingWarmRestartsScheduler("10ba", t_mult=2.0), at(30), 1.0, 1.0),  # 3rd cycle starts
    (PolynomialScheduler(power=2.0, alpha_f=0.1), at(50), 1.0, 0.1 + 0.25 * 0.9),
    (ConstantWithWarmupScheduler("10ba", alpha=0.5), at(4), 1.0, 0.2),
    (ConstantWithWarmupScheduler("10ba", alpha=0.5, t_max="20ba"), at(19, max_duration="20ba"), 1.0, 0.5),
    (ConstantWithWarmupScheduler("10ba", alpha=0.5, t_max="20ba"), at(20, max_duration="20ba"), 1.0, 1.0),
    (LinearWithWarmupScheduler("10ba", alpha_i=1.0, alpha_f=0.0), at(5), 1.0, 0.5),
    (LinearWithWarmupScheduler("10ba", alpha_i=1.0, alpha_f=0.0), at(55), 1.0, 0.5),  # (55-10)/(100-10)
    (CosineAnnealingWithWarmupScheduler("10ba", alpha_f=0.1), at(3), 1.0, 0.3),
    (CosineAnnealingWithWarmupScheduler("10ba", alpha_f=0.1), at(40), 1.0, cos(30 / 90, 0.1)),
    (CosineAnnealingWithWarmupScheduler("0.1dur"), at(sample=50, max_duration="1000sp"), 1.0, 0.5),
    # the warmup is not stretched unless scale_warmup: t_max becomes 200ba, warmup stays 10ba
    (CosineAnnealingWithWarmupScheduler("10ba", t_max="100ba"), at(10), 2.0, 1.0),
    (CosineAnnealingWithWarmupScheduler("10ba", t_max="100ba"), at(105), 2.0, cos(95 / 190)),
    (CosineAnnealingWithWarmupScheduler("10ba", t_max="100ba", scale_warmup=True), at(10), 2.0, 0.5),
    (PolynomialWithWarmupScheduler("10ba", power=2.0), at(55), 1.0, 0.25),
    (MultiStepWithWarmupScheduler("10ba", milestones=["20ba", "40ba"], gamma=0.5), at(5), 1.0, 0.5),
    (MultiStepWithWarmupScheduler("10ba", milestones=["20ba", "40ba"], gamma=0.5), at(45), 1.0, 0.25),
]


@pytest.mark.parametrize("schedule, state, ssr, expected", CASES, ids=[f"{type(c[0]).__name__}-{i}"
                                                                        for i, c in enumerate(CASES)])
def test_formula(schedule, state, ssr, expected) -> None:
    value = schedule(state, ssr)
    assert value == (expected if not isinstance(expected, float) else pytest.approx(expected, rel=1e-12))


def test_durations_that_cannot_be_counted_say_why() -> None:
    assert "has no len()" in error_of(LinearScheduler(t_max="1ep"), at(3, per_epoch=None))
    assert "cycle length fell to 0" in error_of(CosineAnnealingWarmRestartsScheduler("2ba", t_mult=0.4), at(5))
    assert "shorter than one ba" in error_of(StepScheduler("3ba"), at(5), 0.1)


def test_a_one_argument_schedule_cannot_be_stretched() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert "takes only (state)" in error_of(ScheduledLR, opt, lambda state: 1.0, at(0), 2.0)
    stepper = ScheduledLR(opt, lambda state: 0.5 ** state.timestamp.batch.value, at(3))
    stepper.step()
    assert opt.param_groups[0]["lr"] == 0.125 and stepper.state_dict() == {"base_lrs": [1.0]}


class LRs(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def batch_start(self, state, logger=None) -> None:
        self.lrs.append(state.optimizers[0].param_groups[0]["lr"])


def _trainer(schedule, max_duration: str, ssr: float = 1.0, **kw) -> tuple[Trainer, LRs]:
    model = MLP()
    record = LRs()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration=max_duration,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.5), schedulers=schedule,
                      scale_schedule_ratio=ssr, callbacks=[record], progress_bar=False, **kw)
    return trainer, record


def test_the_lr_of_each_batch_is_the_schedule_before_it() -> None:
    """28 samples, batch 4: 7 batches an epoch; warmup over 3 batches, then cosine to 0 at 14."""
    schedule = CosineAnnealingWithWarmupScheduler("3ba")
    trainer, record = _trainer(schedule, "2ep")
    assert trainer.state.optimizers[0].param_groups[0]["lr"] == 0.0  # set at construction: warmup starts at 0
    trainer.fit()
    expected = [0.5 * (b / 3 if b < 3 else cos((b - 3) / 11)) for b in range(14)]
    assert record.lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_scale_schedule_ratio_stretches_max_duration_and_the_schedule() -> None:
    trainer, record = _trainer(LinearScheduler(alpha_f=0.0, t_max="8ba"), "8ba", ssr=1.5)
    assert str(trainer.state.max_duration) == "12ba"
    trainer.fit()
    assert trainer.state.timestamp.batch == 12
    assert record.lrs == pytest.approx([0.5 * (1 - b / 12) for b in range(12)], rel=1e-12)
    assert "positive finite" in error_of(_trainer, LinearScheduler(), "8ba", ssr=float("nan"))
    assert "shrinks max_duration '1ep' to 0" in error_of(_trainer, LinearScheduler(), "1ep", ssr=0.5)


def _torch_lrs(duration: str, every_batch: bool | None, step_size: int) -> list[float]:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    record = LRs()
    Trainer(model=model, train_dataloader=loader(4), max_duration=duration, optimizers=opt, progress_bar=False,
            schedulers=torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=0.5), callbacks=[record],
            step_schedulers_every_batch=every_batch).fit()
    return record.lrs


def test_torch_schedulers_step_every_epoch_unless_asked_to_step_every_batch() -> None:
    # Composer's rule: a torch scheduler counts epochs unless step_schedulers_every_batch=True.
    assert _torch_lrs("2ep", None, 1) == [1.0] * 7 + [0.5] * 7  # 7 batches per epoch
    assert _torch_lrs("2ep", False, 1) == [1.0] * 7 + [0.5] * 7
    assert _torch_lrs("5ba", True, 2) == [1.0, 1.0, 0.5, 0.5, 0.25]
    assert "must be True, False or None" in error_of(_torch_lrs, "1ep", "yes", 1)


def test_scale_schedule_ratio_stretches_torch_schedulers_as_composer_does() -> None:
    # 7 batches per epoch; StepLR every 2 steps stretched by 1.5 steps every 3: lr halves at batches 3 and 6
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    record = LRs()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="6ba", optimizers=opt,
                      schedulers=torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), callbacks=[record],
                      step_schedulers_every_batch=True, scale_schedule_ratio=1.5, progress_bar=False)
    assert str(trainer.state.max_duration) == "9ba"
    trainer.fit()
    assert record.lrs == [1.0] * 3 + [0.5] * 3 + [0.25] * 3
    opt = torch.optim.SGD(MLP().parameters(), lr=1.0)
    multi = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 3, 4], gamma=0.5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    exponential = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.25)
    for scheduler in (multi, cosine, exponential):
        scale_torch_scheduler(scheduler, 0.5)
    assert dict(multi.milestones) == {1: 2, 2: 1} and cosine.T_max == 5 and exponential.gamma == 0.0625
    assert "cannot stretch a LambdaLR" in error_of(
        scale_torch_scheduler, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), 2.0)


def test_token_durations_need_a_token_count() -> None:
    class Tokens(MLP):
        def num_tokens(self, batch):
            return 3 * len(batch[0])  # 3 tokens per sample

    model = Tokens()
    record = LRs()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="120tok", progress_bar=False,
                      optimizers=torch.optim.SGD(model.parameters(), lr=1.0), callbacks=[record],
                      schedulers=LinearScheduler(t_max="60tok"), eval_dataloader=loader(4), eval_interval="48tok")
    evals = []
    trainer.callbacks.append(type("E", (Callback,), {"eval_end": lambda self, s, logger=None: evals.append(
        s.timestamp.token)})())
    trainer.fit()
    assert trainer.state.timestamp.token == 120 and trainer.state.timestamp.batch == 10
    assert record.lrs == pytest.approx([max(0.0, 1 - 12 * b / 60) for b in range(10)])
    assert evals == [48, 96, 120]  # and once more at the end of fit, as in Composer
    plain = MLP()
    message = error_of(Trainer(model=plain, train_dataloader=loader(4), max_duration="10tok", progress_bar=False,
                               optimizers=torch.optim.SGD(plain.parameters(), lr=1.0)).fit)
    assert "counts no tokens" in message and "num_tokens" in message


@pytest.mark.parametrize("scheduler", [
    LinearWithWarmupScheduler("10tok", t_max="100ba"), CosineAnnealingWithWarmupScheduler("0.1dur", t_max="5000sp")])
def test_a_warmup_and_t_max_in_different_units_are_refused_as_in_composer(scheduler) -> None:
    assert error_of(scheduler, at(3)).startswith("Cannot use warmup scheduler ")


def test_a_t_max_shorter_than_the_run_is_refused_as_in_composer() -> None:
    said = error_of(CosineAnnealingWithWarmupScheduler("2ba", t_max="5ep"), at(3, max_duration="6ep"))
    assert "t_max '5ep' (50ba) must be greater than or equal to max_duration 6ep" in said
    assert error_of(CosineAnnealingWithWarmupScheduler("2ba", t_max="6ep"), at(3, max_duration="6ep")) == "no error"
    assert not hasattr(MultiStepWithWarmupScheduler("2ba", milestones=["5ba"]), "t_max")  # it has none to check
