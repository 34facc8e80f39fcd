"""Learning-rate schedules as functions of training time, with Composer's names and formulas.

A schedule ``f`` returns a multiplier: the lr of batch ``b`` is ``base_lr * f(state)``, where
``state.timestamp`` is the progress before batch ``b``. Since the multiplier depends only on the
timestamp, a resumed run (mid-epoch, or on another number of ranks with the same global batch)
continues the schedule exactly.

Every duration is a :class:`~lockstep.time.Time` or a duration string in any unit (``'100ba'``,
``'1ep'``, ``'2e6tok'``, ``'0.05dur'``). How a duration is measured:

* ``dur`` is a share of ``max_duration``, counted in its unit (batches when it is in epochs);
* ``ep`` is counted in batches (``batches_per_epoch`` of them per epoch), so a ``'1ep'`` schedule
  moves every batch;
* the others are counted as they are, against ``state.timestamp``.

``ssr`` (``Trainer(scale_schedule_ratio=)``) stretches every duration except ``dur`` (which
follows the already stretched ``max_duration``) and, unless ``scale_warmup=True``, the warmup.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from lockstep.time import Time, TimeUnit, count

if TYPE_CHECKING:
    from lockstep.state import State

__all__ = [
    "ComposerScheduler", "ConstantScheduler", "ConstantWithWarmupScheduler", "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler", "CosineAnnealingWithWarmupScheduler", "ExponentialScheduler",
    "LinearScheduler", "LinearWithWarmupScheduler", "MultiStepScheduler", "MultiStepWithWarmupScheduler",
    "PolynomialScheduler", "PolynomialWithWarmupScheduler", "StepScheduler",
]

Duration = Time | str


class ComposerScheduler(Protocol):
    """A schedule: ``(state, ssr=1.0) -> lr multiplier``. Any function of this shape works, too."""

    def __call__(self, state: State, ssr: float = 1.0) -> float: ...


def convert(duration: Duration, state: State, ssr: float = 1.0) -> Time:
    """``duration`` as a whole count in a unit the timestamp has, stretched by ``ssr``."""
    time = duration if isinstance(duration, Time) else Time.from_string(duration)
    max_duration = state.max_duration
    if time.unit is TimeUnit.DURATION:
        if max_duration is None:
            raise ValueError(f"the schedule duration '{time}' is a share of max_duration: give the Trainer "
                             f"max_duration")
        if max_duration.unit is TimeUnit.EPOCH:
            return Time(int(time.value * _batches_per_epoch(state, time) * max_duration.value), TimeUnit.BATCH)
        return Time(int(time.value * max_duration.value), max_duration.unit)
    if time.unit is TimeUnit.EPOCH:  # epochs are too coarse to stretch or to move within
        time = Time(time.value * _batches_per_epoch(state, time), TimeUnit.BATCH)
    return Time(int(time.value * ssr), time.unit)


def _batches_per_epoch(state: State, time: Time) -> int:
    """The Trainer's batches per epoch; for a State built by hand, its dataloader's length (Composer's)."""
    known = state.batches_per_epoch
    if not known and getattr(state, "dataloader_len", None) is not None:
        known = int(state.dataloader_len)
    if not known:
        raise ValueError(f"the schedule duration '{time}' is counted in batches per epoch, but the "
                         f"train_dataloader has no len(): give durations in ba, sp or tok")
    return known


def _elapsed(state: State, unit: TimeUnit) -> int:
    return count(state.timestamp, unit)


def _fraction(done: float, total: float) -> float:
    """``done / total`` clipped to [0, 1]; an empty span counts as finished."""
    return 1.0 if total <= 0 else min(max(done / total, 0.0), 1.0)


def _cosine(fraction: float, low: float) -> float:
    return low + (1.0 - low) * (1.0 + math.cos(math.pi * fraction)) / 2.0


class StepScheduler:
    """``gamma ** floor(t / step_size)``."""

    def __init__(self, step_size: Duration, gamma: float = 0.1) -> None:
        self.step_size, self.gamma = step_size, gamma

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        step = convert(self.step_size, state, ssr)
        if step.value <= 0:
            raise ValueError(f"StepScheduler step_size '{self.step_size}' is shorter than one {step.unit.value}")
        return self.gamma ** (_elapsed(state, step.unit) // step.value)


class MultiStepScheduler:
    """``gamma ** (number of milestones reached)``."""

    def __init__(self, milestones: Sequence[Duration], gamma: float = 0.1) -> None:
        self.milestones, self.gamma = list(milestones), gamma

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        factor = 1.0
        for milestone in self.milestones:
            at = convert(milestone, state, ssr)
            if _elapsed(state, at.unit) >= at.value:
                factor *= self.gamma
        return factor


class ConstantScheduler:
    """``alpha`` until ``t_max``, then 1."""

    def __init__(self, alpha: float = 1.0, t_max: Duration = "1dur") -> None:
        self.alpha, self.t_max = alpha, t_max

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        t_max = convert(self.t_max, state, ssr)
        return self.alpha if _elapsed(state, t_max.unit) < t_max.value else 1.0


class LinearScheduler:
    """From ``alpha_i`` to ``alpha_f`` linearly over ``t_max``, then ``alpha_f``."""

    def __init__(self, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: Duration = "1dur") -> None:
        self.alpha_i, self.alpha_f, self.t_max = alpha_i, alpha_f, t_max

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        t_max = convert(self.t_max, state, ssr)
        fraction = _fraction(_elapsed(state, t_max.unit), t_max.value)
        return self.alpha_i + fraction * (self.alpha_f - self.alpha_i)


class ExponentialScheduler:
    """``gamma ** (t / decay_period)``, smoothly."""

    def __init__(self, gamma: float, decay_period: Duration = "1ep") -> None:
        self.gamma, self.decay_period = gamma, decay_period

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        period = convert(self.decay_period, state, ssr)
        if period.value <= 0:
            raise ValueError(f"ExponentialScheduler decay_period '{self.decay_period}' is shorter than one "
                             f"{period.unit.value}")
        return self.gamma ** (_elapsed(state, period.unit) / period.value)


class CosineAnnealingScheduler:
    """``alpha_f + (1 - alpha_f) * (1 + cos(pi * t / t_max)) / 2``, with ``t / t_max`` clipped to [0, 1]."""

    def __init__(self, t_max: Duration = "1dur", alpha_f: float = 0.0) -> None:
        self.t_max, self.alpha_f = t_max, alpha_f

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        t_max = convert(self.t_max, state, ssr)
        return _cosine(_fraction(_elapsed(state, t_max.unit), t_max.value), self.alpha_f)


class CosineAnnealingWarmRestartsScheduler:
    """Cosine annealing that restarts after ``t_0``; each cycle is ``t_mult`` times the previous one."""

    def __init__(self, t_0: Duration, t_mult: float = 1.0, alpha_f: float = 0.0) -> None:
        self.t_0, self.t_mult, self.alpha_f = t_0, t_mult, alpha_f

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        t_0 = convert(self.t_0, state, ssr)
        now, length, end = _elapsed(state, t_0.unit), t_0.value, t_0.value
        while end <= now:
            if length <= 0:
                raise ValueError(f"CosineAnnealingWarmRestartsScheduler: the cycle length fell to 0 "
                                 f"(t_0='{self.t_0}', t_mult={self.t_mult}); use t_mult >= 1")
            length = int(self.t_mult * length)
            end += length
        return _cosine(_fraction(now - (end - length), length), self.alpha_f)


class PolynomialScheduler:
    """``alpha_f + (1 - alpha_f) * (1 - t / t_max) ** power``, with ``t / t_max`` clipped to [0, 1]."""

    def __init__(self, power: float, t_max: Duration = "1dur", alpha_f: float = 0.0) -> None:
        self.power, self.t_max, self.alpha_f = power, t_max, alpha_f

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        t_max = convert(self.t_max, state, ssr)
        fraction = _fraction(_elapsed(state, t_max.unit), t_max.value)
        return self.alpha_f + (1.0 - fraction) ** self.power * (1.0 - self.alpha_f)


class _Warmup:
    """A linear warmup from 0 over ``t_warmup``, then the schedule of :meth:`after` (``t`` counted from
    the start of the run; ``after_fraction`` is the share of (t_warmup, t_max] done).

    As Composer's, one with a ``t_max`` checks at every call that ``t_warmup`` and ``t_max`` are
    counted in the same unit, and that ``t_max`` covers ``max_duration`` where the two compare."""

    def __init__(self, t_warmup: Duration, t_max: Duration | None, peak: float, scale_warmup: bool) -> None:
        self.t_warmup, self.peak, self.scale_warmup = t_warmup, peak, scale_warmup
        if t_max is not None:  # MultiStepWithWarmupScheduler has none, as in Composer
            self.t_max = t_max

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        warmup = convert(self.t_warmup, state, ssr if self.scale_warmup else 1.0)
        if hasattr(self, "t_max"):
            _check_warmup_and_max(self, warmup, convert(self.t_max, state, ssr), state)
        if warmup.value == 0:
            warnings.warn(f"{type(self).__name__}: the warmup '{self.t_warmup}' is 0 {warmup.unit.value} long "
                          f"(a 'dur' warmup is counted in max_duration's unit)", stacklevel=2)
        now = _elapsed(state, warmup.unit)
        if now < warmup.value:
            return self.peak * now / warmup.value
        return self.after(state, ssr, warmup, now)

    def after_fraction(self, state: State, ssr: float, warmup: Time, now: int) -> float:
        """The share of (t_warmup, t_max] done; 0 when the warmup fills t_max (as in Composer: the
        schedule then stays at its peak)."""
        t_max = convert(self.t_max, state, ssr)
        if t_max.value <= warmup.value:
            return 0.0
        return _fraction(now - warmup.value, t_max.value - warmup.value)

    def after(self, state: State, ssr: float, warmup: Time, now: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


def _check_warmup_and_max(scheduler: _Warmup, warmup: Time, t_max: Time, state: State) -> None:
    """Composer's checks: both counted in one unit, and ``t_max`` (as counted) not shorter than
    ``max_duration`` where the two are comparable (epochs and batches are, through the epoch length)."""
    if warmup.unit is not t_max.unit:
        raise ValueError(f"Cannot use warmup scheduler {type(scheduler).__name__} with t_warmup "
                         f"'{scheduler.t_warmup}' and t_max '{scheduler.t_max}': they count in different units "
                         f"({warmup.unit.value}, {t_max.unit.value}); give both in the same unit")
    max_duration = state.max_duration
    if max_duration is None:
        return
    needed = max_duration.value
    if t_max.unit is TimeUnit.BATCH and max_duration.unit is TimeUnit.EPOCH:
        needed = max_duration.value * _batches_per_epoch(state, max_duration)
    elif t_max.unit is not max_duration.unit:
        return  # not comparable: nothing to check
    if t_max.value < needed:
        raise ValueError(f"{type(scheduler).__name__}: t_max '{scheduler.t_max}' ({t_max}) must be greater than or "
                         f"equal to max_duration {max_duration}, or the schedule ends before training does")


class ConstantWithWarmupScheduler(_Warmup):
    """Warm up linearly to ``alpha`` over ``t_warmup``, hold it until ``t_max``, then 1."""

    def __init__(self, t_warmup: Duration, alpha: float = 1.0, t_max: Duration = "1dur",
                 scale_warmup: bool = False) -> None:
        super().__init__(t_warmup, t_max, alpha, scale_warmup)
        self.alpha = alpha

    def after(self, state: State, ssr: float, warmup: Time, now: int) -> float:
        return ConstantScheduler(self.alpha, self.t_max)(state, ssr)


class LinearWithWarmupScheduler(_Warmup):
    """Warm up linearly to ``alpha_i`` over ``t_warmup``, then go linearly to ``alpha_f`` at ``t_max``."""

    def __init__(self, t_warmup: Duration, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: Duration = "1dur",
                 scale_warmup: bool = False) -> None:
        super().__init__(t_warmup, t_max, alpha_i, scale_warmup)
        self.alpha_i, self.alpha_f = alpha_i, alpha_f

    def after(self, state: State, ssr: float, warmup: Time, now: int) -> float:
        return self.alpha_i + self.after_fraction(state, ssr, warmup, now) * (self.alpha_f - self.alpha_i)


class CosineAnnealingWithWarmupScheduler(_Warmup):
    """Warm up linearly to 1 over ``t_warmup``, then ``alpha_f + (1 - alpha_f) * (1 + cos(pi * frac)) / 2``
    where ``frac`` is the share of (t_warmup, t_max] done."""

    def __init__(self, t_warmup: Duration, t_max: Duration = "1dur", alpha_f: float = 0.0,
                 scale_warmup: bool = False) -> None:
        super().__init__(t_warmup, t_max, 1.0, scale_warmup)
        self.alpha_f = alpha_f

    def after(self, state: State, ssr: float, warmup: Time, now: int) -> float:
        return _cosine(self.after_fraction(state, ssr, warmup, now), self.alpha_f)


class PolynomialWithWarmupScheduler(_Warmup):
    """Warm up linearly to 1 over ``t_warmup``, then ``alpha_f + (1 - alpha_f) * (1 - frac) ** power``."""

    def __init__(self, t_warmup: Duration, power: float = 2.0, t_max: Duration = "1dur", alpha_f: float = 0.0,
                 scale_warmup: bool = False) -> None:
        super().__init__(t_warmup, t_max, 1.0, scale_warmup)
        self.power, self.alpha_f = power, alpha_f

    def after(self, state: State, ssr: float, warmup: Time, now: int) -> float:
        fraction = self.after_fraction(state, ssr, warmup, now)
        return self.alpha_f + (1.0 - fraction) ** self.power * (1.0 - self.alpha_f)


class MultiStepWithWarmupScheduler(_Warmup):
    """Warm up linearly to 1 over ``t_warmup``, then ``gamma ** (milestones reached)``."""

    def __init__(self, t_warmup: Duration, milestones: Sequence[Duration], gamma: float = 0.1,
                 scale_warmup: bool = False) -> None:
        super().__init__(t_warmup, None, 1.0, scale_warmup)
        self.milestones, self.gamma = list(milestones), gamma

    def after(self, state: State, ssr: float, warmup: Time, now: int) -> float:
        return MultiStepScheduler(self.milestones, self.gamma)(state, ssr)
