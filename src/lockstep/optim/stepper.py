"""Turn schedules of training time into objects the Trainer steps and checkpoints like torch's."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import lr_scheduler as torch_schedulers

if TYPE_CHECKING:
    from lockstep.state import State


class ScheduledLR:
    """Sets every param group's lr to ``initial_lr * schedule(state, ssr)`` on each :meth:`step`.

    Holds no progress of its own: the lr follows ``state.timestamp``, so a checkpoint needs only the
    base lrs, and stepping twice at the same timestamp changes nothing.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[..., float], state: State,
                 ssr: float = 1.0) -> None:
        self.optimizer, self.schedule, self._state, self.ssr = optimizer, schedule, state, ssr
        self._takes_ssr = _takes_ssr(schedule)
        if not self._takes_ssr and ssr != 1.0:
            raise ValueError(f"the schedule {schedule!r} takes only (state), so it cannot follow "
                             f"scale_schedule_ratio={ssr}: give it a second parameter ssr=1.0")
        self.base_lrs = [group.setdefault("initial_lr", group["lr"]) for group in optimizer.param_groups]
        self._last_lr = [group["lr"] for group in optimizer.param_groups]

    def multiplier(self) -> float:
        """The schedule's value at the current timestamp."""
        value = self.schedule(self._state, self.ssr) if self._takes_ssr else self.schedule(self._state)
        return float(value)

    def step(self) -> None:
        factor = self.multiplier()
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        base_lrs = state_dict["base_lrs"]
        if len(base_lrs) != len(self.optimizer.param_groups):
            raise ValueError(f"the checkpoint's schedule has {len(base_lrs)} param groups, the optimizer "
                             f"{len(self.optimizer.param_groups)}")
        self.base_lrs = list(base_lrs)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["initial_lr"] = base

    def __repr__(self) -> str:
        return f"ScheduledLR({self.schedule!r}, ssr={self.ssr})"


def compile_composer_scheduler(scheduler: Callable[..., float], state: State, ssr: float = 1.0) -> ScheduledLR:
    """Bind a schedule to ``state``'s only optimizer, as Composer's function of this name does: the
    result is already stepped once (the lr is the schedule's value now) and has ``step``,
    ``get_last_lr`` and ``state_dict``. The Trainer does this itself for the ``schedulers`` it gets."""
    if len(state.optimizers) != 1:
        raise ValueError(f"compile_composer_scheduler binds a schedule to one optimizer and the state has "
                         f"{len(state.optimizers)}: make a ScheduledLR(optimizer, schedule, state) for each")
    compiled = ScheduledLR(state.optimizers[0], scheduler, state, ssr)
    compiled.step()
    return compiled


def _takes_ssr(schedule: Callable[..., float]) -> bool:
    try:
        parameters = inspect.signature(schedule).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def is_torch_scheduler(scheduler: Any) -> bool:
    """A torch scheduler (or anything with ``step`` and ``state_dict``), as opposed to a schedule."""
    return hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")


def compile_schedulers(schedulers: list[Any], state: State, ssr: float) -> list[Any]:
    """Keep torch schedulers; wrap each schedule of training time in a :class:`ScheduledLR` per
    optimizer."""
    compiled: list[Any] = []
    for i, scheduler in enumerate(schedulers):
        if is_torch_scheduler(scheduler):
            _check_steps_an_optimizer_of(scheduler, i, state.optimizers)
            compiled.append(scale_torch_scheduler(scheduler, ssr))
        elif callable(scheduler):
            compiled.extend(ScheduledLR(optimizer, scheduler, state, ssr) for optimizer in state.optimizers)
        else:
            raise TypeError(f"schedulers[{i}] is a {type(scheduler).__name__}: give a torch lr scheduler or a "
                            f"schedule from lockstep.optim (a callable (state, ssr) -> multiplier)")
    return compiled


def _check_steps_an_optimizer_of(scheduler: Any, index: int, optimizers: list[torch.optim.Optimizer]) -> None:
    """A torch scheduler built on another optimizer than the Trainer's would change nothing that
    trains: a one-line ValueError naming both."""
    optimizer = getattr(scheduler, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or any(optimizer is o for o in optimizers):
        return
    held = ", ".join(type(o).__name__ for o in optimizers) or "none"
    name = type(scheduler).__name__
    raise ValueError(f"schedulers[{index}] ({name}) steps a {type(optimizer).__name__} that is not one of the "
                     f"Trainer's optimizers ({held}), so training would go on without its schedule: build it on "
                     f"the optimizer given as optimizers=..., e.g. {name}(optimizer, ...)")


def scale_torch_scheduler(scheduler: Any, ssr: float) -> Any:
    """Stretch a torch scheduler's schedule by ``scale_schedule_ratio`` in place, as Composer does
    for the torch schedulers it knows; any other one cannot be stretched, so with a ratio other
    than 1 it is an error rather than a schedule that silently ends early or late."""
    if ssr == 1.0:
        return scheduler
    if isinstance(scheduler, torch_schedulers.StepLR):
        scheduler.step_size = int(scheduler.step_size * ssr)
    elif isinstance(scheduler, torch_schedulers.MultiStepLR):
        milestones: Counter[int] = Counter()
        for milestone, count in scheduler.milestones.items():  # milestones that meet add up
            milestones[int(milestone * ssr)] += count
        scheduler.milestones = milestones
    elif isinstance(scheduler, torch_schedulers.CosineAnnealingLR):
        scheduler.T_max = int(scheduler.T_max * ssr)
    elif isinstance(scheduler, torch_schedulers.CosineAnnealingWarmRestarts):
        scheduler.T_0 = int(scheduler.T_0 * ssr)
    elif isinstance(scheduler, torch_schedulers.ExponentialLR):
        scheduler.gamma = scheduler.gamma ** (1 / ssr)  # the same total decay over the stretched time
    else:
        raise ValueError(f"scale_schedule_ratio={ssr} cannot stretch a {type(scheduler).__name__}: use StepLR, "
                         f"MultiStepLR, CosineAnnealingLR, CosineAnnealingWarmRestarts or ExponentialLR, or a "
                         f"schedule from lockstep.optim")
    return scheduler
