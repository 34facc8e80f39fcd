"""Learning-rate schedules in training time (see :mod:`lockstep.optim.schedulers`)."""

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
from lockstep.optim.stepper import ScheduledLR, compile_schedulers

__all__ = [
    "ComposerScheduler", "ConstantScheduler", "ConstantWithWarmupScheduler", "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler", "CosineAnnealingWithWarmupScheduler", "ExponentialScheduler",
    "LinearScheduler", "LinearWithWarmupScheduler", "MultiStepScheduler", "MultiStepWithWarmupScheduler",
    "PolynomialScheduler", "PolynomialWithWarmupScheduler", "ScheduledLR", "StepScheduler", "compile_schedulers",
]
