"""Composer's path for the schedules (``composer.optim.scheduler``): every name here is the same
object as in :mod:`lockstep.optim.schedulers` and :mod:`lockstep.optim`."""

from lockstep.optim.schedulers import *  # noqa: F403
from lockstep.optim.schedulers import __all__ as _SCHEDULES
from lockstep.optim.schedulers import convert as _convert_time  # noqa: F401 - Composer's private name, which tests reach for
from lockstep.optim.stepper import compile_composer_scheduler

__all__ = [*_SCHEDULES, "compile_composer_scheduler"]
