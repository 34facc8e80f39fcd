"""Training durations: ``Time`` values such as ``'2ep'`` and the ``Timestamp`` of training progress.

Grammar of a duration string: a non-negative number followed by a unit, optionally surrounded by
whitespace, with underscores allowed between digits::

    160ep   2ba   1_000sp   3e4tok   1e6tok   0.5dur

``ep ba sp tok`` are whole counts (scientific notation is fine when the value is whole); ``dur``
is a fraction in (0, 1] of the run's ``max_duration``. Samples and tokens count over all ranks.

The trainer uses three helpers: :func:`is_reached` (stop at the first batch boundary where the
timestamp reaches ``max_duration``), :func:`is_interval_due` (save/eval intervals) and
:func:`fraction_done` (progress and ETA).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from fractions import Fraction
from collections.abc import Callable
from typing import Any

__all__ = ["Time", "TimeUnit", "Timestamp", "check_max_duration", "fraction_done",
           "is_interval_due", "is_reached", "time_argument"]


class TimeUnit(StrEnum):
    """Unit of a :class:`Time`; the value is the suffix used in duration strings."""

    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"


_HINT = "expected a number followed by one of ep, ba, sp, tok, dur (e.g. '2ep', '100ba', '0.5dur')"
_DIGITS = r"\d(?:_?\d)*"
# the exponent is capped so that '1e999999999tok' cannot make int() build a huge number
_PATTERN = re.compile(
    rf"(?P<number>(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:[eE][+-]?\d{{1,3}})?)"
    r"(?P<unit>ep|ba|sp|tok|dur)"
)


def _normalize(value: int | float, unit: TimeUnit) -> int | float:
    """Return ``value`` in the canonical type for ``unit``; raise ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a Time value must be an int or a float, got {type(value).__name__}")
    if unit is TimeUnit.DURATION:
        if not 0 < value <= 1:
            raise ValueError("'dur' is a fraction of max_duration and must be in (0, 1]")
        return float(value)
    if not isinstance(value, int):
        raise ValueError(f"'{unit}' counts must be whole numbers")
    if value < 0:
        raise ValueError("durations cannot be negative")
    return value


@dataclass(frozen=True, slots=True)
class Time:
    """An immutable duration: a whole count of ``ep ba sp tok``, or a ``dur`` fraction in (0, 1].

    Times of the same unit compare and add; mixing units raises TypeError. ``str(t)`` gives the
    string form back (``str(Time.from_string('2ep')) == '2ep'``).
    """

    value: int | float
    unit: TimeUnit

    def __post_init__(self) -> None:
        try:
            unit = TimeUnit(self.unit)
        except ValueError:
            raise ValueError(f"invalid time unit {self.unit!r}: {_HINT}") from None
        try:
            value = _normalize(self.value, unit)
        except ValueError as e:
            raise ValueError(f"invalid duration '{self.value}{unit}': {e}; {_HINT}") from None
        object.__setattr__(self, "unit", unit)
        object.__setattr__(self, "value", value)

    @classmethod
    def from_string(cls, text: str) -> Time:
        """Parse a duration string such as ``'160ep'``, ``'1_000sp'``, ``'3e4tok'``."""
        if not isinstance(text, str):
            raise TypeError(f"a duration string must be a str, got {type(text).__name__}")
        if cls is Time:  # schedules hold their durations as strings and read them every batch
            return _parse(text)
        return cls._parse_string(text)

    @classmethod
    def _parse_string(cls, text: str) -> Time:
        match = _PATTERN.fullmatch(text.strip())
        if match is None:
            reason = "durations cannot be negative; " if text.strip().startswith("-") else ""
            raise ValueError(f"invalid duration {text!r}: {reason}{_HINT}")
        unit = TimeUnit(match["unit"])
        number = Decimal(match["number"].replace("_", ""))
        value: int | float
        if unit is TimeUnit.DURATION:
            value = float(number)
        elif number == number.to_integral_value():
            value = int(number)
        else:
            value = float(number)  # _normalize rejects it with the reason
        try:
            return cls(_normalize(value, unit), unit)
        except ValueError as e:
            raise ValueError(f"invalid duration {text!r}: {e}; {_HINT}") from None

    @classmethod
    def from_input(
        cls, value: Time | str | int, default_unit: TimeUnit | str | None = None
    ) -> Time:
        """Accept a Time, a duration string, or a bare int counted in ``default_unit``."""
        if isinstance(value, Time):
            return value
        if isinstance(value, str):
            return cls.from_string(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if default_unit is None:
                raise ValueError(f"got the number {value} without a unit: write it as a string "
                                 f"such as '{value}ep' or '{value}ba'")
            return cls(value, TimeUnit(default_unit))
        raise TypeError(f"expected a Time, a duration string such as '2ep', or an int; "
                        f"got {type(value).__name__}")

    def require_positive(self, name: str) -> Time:
        """Return self if the value is above zero; otherwise raise ValueError naming ``name``."""
        if self.value <= 0:
            raise ValueError(f"{name} must be positive, got '{self}'")
        return self

    def __str__(self) -> str:
        return f"{self.value}{self.unit.value}"

    def __repr__(self) -> str:
        return f"Time('{self}')"

    def _same_unit(self, other: Time, verb: str) -> None:
        if self.unit is not other.unit:
            raise TypeError(f"cannot {verb} '{self}' and '{other}': units '{self.unit.value}' and "
                            f"'{other.unit.value}' differ")

    def _compare(self, other: object, op: Callable[[Any, Any], bool]) -> bool:
        if not isinstance(other, Time):
            return NotImplemented
        self._same_unit(other, "compare")
        return op(self.value, other.value)

    def __lt__(self, other: object) -> bool:
        return self._compare(other, operator.lt)

    def __le__(self, other: object) -> bool:
        return self._compare(other, operator.le)

    def __gt__(self, other: object) -> bool:
        return self._compare(other, operator.gt)

    def __ge__(self, other: object) -> bool:
        return self._compare(other, operator.ge)

    def __add__(self, other: object) -> Time:
        if not isinstance(other, Time):
            return NotImplemented
        self._same_unit(other, "add")
        return Time(self.value + other.value, self.unit)

    def __sub__(self, other: object) -> Time:
        if not isinstance(other, Time):
            return NotImplemented
        self._same_unit(other, "subtract")
        return Time(self.value - other.value, self.unit)


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> Time:
    return Time._parse_string(text)


@dataclass(frozen=True, slots=True)
class Timestamp:
    """Training progress: completed epochs, batches, samples and tokens, in total and in this epoch.

    ``sample`` and ``token`` (and their in-epoch counts) are summed over all ranks. Every update
    returns a new Timestamp.
    """

    epoch: int = 0
    batch: int = 0
    sample: int = 0
    token: int = 0
    batch_in_epoch: int = 0
    sample_in_epoch: int = 0
    token_in_epoch: int = 0

    def __post_init__(self) -> None:
        for name in TIMESTAMP_FIELDS:  # a new Timestamp every batch: a tuple, not dataclasses.fields()
            value = getattr(self, name)
            if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)) or value < 0:
                raise ValueError(f"Timestamp.{name} must be a non-negative int, got {value!r}")

    def get(self, unit: TimeUnit | str) -> int:
        """Return the count in ``unit`` (``ep ba sp tok``)."""
        name = _COUNT_OF.get(unit)  # the Trainer asks every batch: a lookup, not an enum call
        if name is None:  # 'dur', or not a unit at all: TimeUnit() names what is wrong
            TimeUnit(unit)
            raise ValueError("a Timestamp has no 'dur' count; use fraction_done(timestamp, max_duration)")
        return getattr(self, name)

    def to_next_batch(self, samples: int, tokens: int = 0) -> Timestamp:
        """Return the timestamp after one more batch of ``samples`` and ``tokens`` (all ranks)."""
        if samples < 0 or tokens < 0:
            raise ValueError(
                f"samples and tokens must be >= 0, got samples={samples}, tokens={tokens}")
        if type(samples) is not int or type(tokens) is not int:  # the constructor says what is wrong
            return Timestamp(self.epoch, self.batch + 1, self.sample + samples, self.token + tokens,
                             self.batch_in_epoch + 1, self.sample_in_epoch + samples, self.token_in_epoch + tokens)
        # Sums of checked ints need no checking again: the fields are set directly, without the
        # generated __init__ and __post_init__ (this runs every batch, with the caches cold).
        after = _new_timestamp(Timestamp)
        _set(after, "epoch", self.epoch)
        _set(after, "batch", self.batch + 1)
        _set(after, "sample", self.sample + samples)
        _set(after, "token", self.token + tokens)
        _set(after, "batch_in_epoch", self.batch_in_epoch + 1)
        _set(after, "sample_in_epoch", self.sample_in_epoch + samples)
        _set(after, "token_in_epoch", self.token_in_epoch + tokens)
        return after

    def to_next_epoch(self) -> Timestamp:
        """Return the timestamp after the end of this epoch, with the in-epoch counts reset."""
        return dataclasses.replace(self, epoch=self.epoch + 1, batch_in_epoch=0, sample_in_epoch=0,
                                   token_in_epoch=0)

    def state_dict(self) -> dict[str, int]:
        """Return the counts as a plain dict, for checkpoints (and every logged batch: not
        ``dataclasses.asdict``, whose deep copy costs tens of microseconds)."""
        return {name: getattr(self, name) for name in TIMESTAMP_FIELDS}

    @classmethod
    def from_state_dict(cls, state: dict[str, int]) -> Timestamp:
        """Rebuild a Timestamp from :meth:`state_dict`; missing or unknown keys are an error."""
        if not isinstance(state, dict):
            raise TypeError(f"a Timestamp state_dict must be a dict, got {type(state).__name__}")
        expected = {field.name for field in dataclasses.fields(cls)}
        missing, unknown = expected - state.keys(), state.keys() - expected
        if missing or unknown:
            raise ValueError(f"invalid Timestamp state_dict: missing keys {sorted(missing)}, "
                             f"unknown keys {sorted(map(str, unknown))}; "
                             f"expected {sorted(expected)}")
        try:
            # operator.index also accepts numpy integers and 0-d integer tensors from a checkpoint
            counts = {name: operator.index(state[name]) for name in expected}
        except TypeError:
            raise ValueError(
                f"invalid Timestamp state_dict: values must be ints, got {state!r}") from None
        return cls(**counts)


_new_timestamp, _set = object.__new__, object.__setattr__

# a StrEnum member hashes and compares as its value: "ba" finds TimeUnit.BATCH here
_COUNT_OF: dict[TimeUnit | str, str] = {TimeUnit.EPOCH: "epoch", TimeUnit.BATCH: "batch",
                                        TimeUnit.SAMPLE: "sample", TimeUnit.TOKEN: "token"}

TIMESTAMP_FIELDS = tuple(field.name for field in dataclasses.fields(Timestamp))
"""The names of a Timestamp's counts, in the order its ``state_dict`` lists them."""


def time_argument(name: str, value: Time | str | int) -> Time:
    """Parse the argument ``name`` (an int counts epochs, as in Composer) and check it is positive;
    an error names the argument."""
    try:
        return Time.from_input(value, TimeUnit.EPOCH).require_positive(name)
    except (TypeError, ValueError) as e:
        message = str(e) if str(e).startswith(name) else f"{name}={value!r}: {e}"
        raise type(e)(message) from None


def check_max_duration(max_duration: Time | str | int) -> Time:
    """Parse ``max_duration`` and check it is a positive count (it cannot be a ``dur`` fraction)."""
    max_duration = time_argument("max_duration", max_duration)
    if max_duration.unit is TimeUnit.DURATION:
        raise ValueError(f"max_duration cannot be in 'dur' (got '{max_duration}'): 'dur' is a "
                         f"fraction of max_duration itself; give it in ep, ba, sp or tok, "
                         f"e.g. '2ep'")
    return max_duration


def _resolve(
    duration: Time, max_duration: Time | str | None, name: str
) -> tuple[TimeUnit, int | Fraction]:
    """Return ``duration`` as (count unit, exact amount); ``dur`` is a share of max_duration.

    A whole count stays an int: the Trainer checks limits and intervals every batch, and Fraction
    arithmetic there costs microseconds each."""
    if max_duration is not None:
        max_duration = check_max_duration(max_duration)
    if duration.unit is not TimeUnit.DURATION:
        return duration.unit, int(duration.value)
    if max_duration is None:
        raise ValueError(
            f"{name} '{duration}' is a fraction of max_duration, so max_duration is needed")
    # the decimal the user wrote, not its binary float: 0.1dur of 30ba is exactly 3 batches
    return max_duration.unit, Fraction(repr(duration.value)) * max_duration.value


def is_reached(
    timestamp: Timestamp, limit: Time | str, max_duration: Time | str | None = None
) -> bool:
    """Return True once ``timestamp`` has reached ``limit`` (checked at batch or epoch boundaries).

    A ``dur`` limit is a fraction of ``max_duration``. With 64 samples, a global batch of 16 and a
    limit of ``'40sp'``, this first holds after the 3rd batch (48 >= 40).
    """
    if _whole_count(limit, max_duration):  # the Trainer asks every batch: no parsing, no frames
        return getattr(timestamp, _COUNT_OF[limit.unit]) >= limit.value  # type: ignore[union-attr]
    unit, amount = _resolve(Time.from_input(limit), max_duration, "limit")
    return timestamp.get(unit) >= amount


def is_interval_due(timestamp_before: Timestamp, timestamp_after: Timestamp, interval: Time | str,
                    max_duration: Time | str | None = None) -> bool:
    """Return True when a multiple of ``interval`` was crossed between the two timestamps.

    Call it around each batch (``ba sp tok`` intervals fire there) and around each epoch end
    (``ep`` intervals fire there); a count that did not change between the two is never due.
    ``'100sp'`` fires at the first batch boundary at or after each multiple of 100 samples; a
    ``dur`` interval is a fraction of ``max_duration``: ``'0.25dur'`` of ``'8ba'`` is every 2
    batches.
    """
    if _whole_count(interval, max_duration) and interval.value > 0:  # type: ignore[union-attr]
        name, step = _COUNT_OF[interval.unit], interval.value  # type: ignore[union-attr]
        return getattr(timestamp_after, name) // step > getattr(timestamp_before, name) // step
    interval = Time.from_input(interval).require_positive("interval")
    unit, step = _resolve(interval, max_duration, "interval")
    return timestamp_after.get(unit) // step > timestamp_before.get(unit) // step


def _whole_count(duration: Time | str, max_duration: Time | str | None) -> bool:
    """Whether ``duration`` is already a Time counted in ``ep ba sp tok`` and ``max_duration`` needs
    no checking: then a Timestamp's attribute answers without parsing or resolving anything."""
    return (type(duration) is Time and duration.unit is not TimeUnit.DURATION
            and (max_duration is None or type(max_duration) is Time and max_duration.unit is not TimeUnit.DURATION))


def fraction_done(timestamp: Timestamp, max_duration: Time | str, *,
                  batches_per_epoch: int | None = None) -> float:
    """Return the share of ``max_duration`` done, in [0, 1], for progress bars and ETAs.

    With an ``ep`` max_duration, ``batches_per_epoch`` (when known) adds progress within the epoch.
    """
    max_duration = check_max_duration(max_duration)
    done = float(timestamp.get(max_duration.unit))
    if max_duration.unit is TimeUnit.EPOCH and batches_per_epoch:
        done += min(timestamp.batch_in_epoch / batches_per_epoch, 1.0)
    return min(done / max_duration.value, 1.0)
