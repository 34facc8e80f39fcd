"""Composer's module paths for the optimizers and schedules name lockstep's objects, not copies."""

from __future__ import annotations

import lockstep.optim
import lockstep.optim.scheduler
import lockstep.optim.schedulers
import lockstep.optim.stepper

# composer.optim.scheduler.__all__ and composer.optim.__all__ in Composer 0.32.1
COMPOSER_SCHEDULER = {
    "ComposerScheduler", "compile_composer_scheduler", "StepScheduler", "MultiStepScheduler", "ConstantScheduler",
    "LinearScheduler", "ExponentialScheduler", "CosineAnnealingScheduler", "CosineAnnealingWarmRestartsScheduler",
    "PolynomialScheduler", "MultiStepWithWarmupScheduler", "ConstantWithWarmupScheduler",
    "LinearWithWarmupScheduler", "CosineAnnealingWithWarmupScheduler", "PolynomialWithWarmupScheduler",
}
COMPOSER_OPTIM = COMPOSER_SCHEDULER | {"DecoupledAdamW", "DecoupledSGDW"}


def test_every_name_at_composers_scheduler_path_is_lockstep_optims_object() -> None:
    assert set(lockstep.optim.scheduler.__all__) == COMPOSER_SCHEDULER
    for name in lockstep.optim.scheduler.__all__:
        obj = getattr(lockstep.optim.scheduler, name)
        assert obj is getattr(lockstep.optim, name), name
        home = lockstep.optim.stepper if name == "compile_composer_scheduler" else lockstep.optim.schedulers
        assert obj is getattr(home, name), name


def test_lockstep_optim_has_every_name_of_composer_optim() -> None:
    assert COMPOSER_OPTIM <= set(lockstep.optim.__all__)
    for name in lockstep.optim.__all__:
        assert hasattr(lockstep.optim, name), name
