"""Optimizers with decoupled weight decay (:mod:`lockstep.optim.decoupled`) and learning-rate
schedules in training time (:mod:`lockstep.optim.schedulers`, also at Composer's path
:mod:`lockstep.optim.scheduler`)."""

from lockstep.optim.decoupled import DecoupledAdamW, DecoupledSGDW
from lockstep.optim.schedulers import (
    ComposerScheduler,
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
    StepScheduler,
)
from lockstep.optim.stepper import ScheduledLR, compile_composer_scheduler, compile_schedulers

__all__ = [
    "ComposerScheduler", "ConstantScheduler", "ConstantWithWarmupScheduler", "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler", "CosineAnnealingWithWarmupScheduler", "DecoupledAdamW", "DecoupledSGDW",
    "ExponentialScheduler", "LinearScheduler", "LinearWithWarmupScheduler", "MultiStepScheduler",
    "MultiStepWithWarmupScheduler", "PolynomialScheduler", "PolynomialWithWarmupScheduler", "ScheduledLR",
    "StepScheduler", "compile_composer_scheduler", "compile_schedulers",
]
