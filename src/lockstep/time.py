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

import datetime
import functools
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from fractions import Fraction
from typing import Any, Generic, TypeVar

__all__ = ["Time", "TimeTypeError", "TimeUnit", "Timestamp", "check_max_duration", "ensure_time", "fraction_done",
           "is_interval_due", "is_reached", "time_argument"]


class TimeUnit(StrEnum):
    """Unit of a :class:`Time`; the value is the suffix used in duration strings."""

    ITERATION = "iter"
    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"
    SECOND = "sec"
    """Wall-clock seconds of training (``'90sec'``, or ``'1h20m40s'``): a max_duration in seconds
    stops at the first batch boundary past it."""


class TimeTypeError(TypeError, ValueError, RuntimeError):
    """A value that cannot be a Time: a count that is not whole, or an object of another type.
    Composer raises TypeError for the first and RuntimeError for the second; it is both (and a
    ValueError, which lockstep raised before)."""


_HINT = ("expected a number followed by one of ep, ba, sp, tok, dur, iter, sec (e.g. '2ep', '100ba', '0.5dur'), "
         "or hours, minutes and seconds such as '1h20m40s'")
_WALL_CLOCK = re.compile(r"(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+)s)?")
_DIGITS = r"\d(?:_?\d)*"
# the exponent is capped so that '1e999999999tok' cannot make int() build a huge number
_PATTERN = re.compile(
    rf"(?P<number>(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:[eE][+-]?\d{{1,3}})?)"
    r"(?P<unit>iter|ep|ba|sp|tok|dur|sec)"
)


def _check_count(value: int | float, unit: TimeUnit) -> int | float:
    """``value`` as a Time in ``unit`` holds it: a float for ``dur``, an int for the counts."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a Time value must be an int or a float, got {type(value).__name__}")
    if unit is TimeUnit.DURATION:
        return float(value)
    if not isinstance(value, int):
        raise TypeError(f"'{unit.value}' counts whole {_NOUN[unit]}, got {value!r}: give an int")
    return value


def _check_duration(value: int | float, unit: TimeUnit) -> None:
    """What a duration written by a user must be: not negative (``dur`` included, which may pass 1,
    as in Composer: a schedule's ``t_max`` may outlast the run)."""
    if unit is TimeUnit.DURATION and not math.isfinite(value):
        raise ValueError("a 'dur' fraction of max_duration must be a finite number")
    if value < 0:
        raise ValueError("durations cannot be negative")


_NOUN = {TimeUnit.ITERATION: "iterations", TimeUnit.EPOCH: "epochs", TimeUnit.BATCH: "batches", TimeUnit.SAMPLE: "samples", TimeUnit.TOKEN: "tokens"}
TValue = TypeVar("TValue", int, float)


@dataclass(frozen=True, slots=True, eq=False)
class Time(Generic[TValue]):
    """An amount of training time, as in Composer: ``Time(10, 'ba')``, ``Time(0.5, TimeUnit.DURATION)``.

    ``ep ba sp tok`` hold ints, ``dur`` (a fraction of ``max_duration``) a float. A Time compares
    with, adds and subtracts a Time, a duration string or a plain number, which is taken in its own
    unit (``Time(10, 'ba') == 10``); two different units raise RuntimeError. Multiplying or dividing
    by a number scales it; a Time divided by one of its unit is a ``dur`` (their ratio).
    ``str(t)`` gives the duration string (``'10ba'``), ``int(t)`` and ``float(t)`` the value. A
    Time hashes as its value and is false when zero, as the number it equals.
    """

    value: TValue
    unit: TimeUnit

    def __post_init__(self) -> None:
        try:
            unit = TimeUnit(self.unit)
        except ValueError:
            raise ValueError(f"invalid time unit {self.unit!r}: {_HINT}") from None
        object.__setattr__(self, "unit", unit)
        object.__setattr__(self, "value", _check_count(self.value, unit))

    @classmethod
    def from_timestring(cls, timestring: str) -> Time:
        """Parse a duration string such as ``'160ep'``, ``'1_000sp'``, ``'3e4tok'``, ``'0.5dur'``."""
        if not isinstance(timestring, str):
            raise TypeError(f"a duration string must be a str, got {type(timestring).__name__}")
        if cls is Time:  # schedules hold their durations as strings and read them every batch
            return _parse(timestring)
        return cls._parse_string(timestring)

    from_string = from_timestring

    @classmethod
    def _parse_string(cls, text: str) -> Time:
        clock = _WALL_CLOCK.fullmatch(text.strip())
        if clock is not None and clock.group(0):
            return cls.from_timedelta(text)
        match = _PATTERN.fullmatch(text.strip())
        if match is None:
            reason = "durations cannot be negative; " if text.strip().startswith("-") else ""
            raise ValueError(f"invalid duration {text!r}: {reason}{_HINT}")
        unit = TimeUnit(match["unit"])
        number = Decimal(match["number"].replace("_", ""))
        try:
            if unit is not TimeUnit.DURATION and number != number.to_integral_value():
                raise TimeTypeError(f"'{unit.value}' counts must be whole numbers")
            value = float(number) if unit is TimeUnit.DURATION else int(number)
            _check_duration(value, unit)
        except TimeTypeError as e:
            raise TimeTypeError(f"invalid duration {text!r}: {e}; {_HINT}") from None
        except ValueError as e:
            raise ValueError(f"invalid duration {text!r}: {e}; {_HINT}") from None
        return cls(value, unit)

    @classmethod
    def from_timedelta(cls, timestring: str) -> Time:
        """Hours, minutes and seconds (``'1h20m40s'``, ``'20m'``, ``'90s'``) as a Time in seconds."""
        clock = _WALL_CLOCK.fullmatch(timestring.strip())
        if clock is None or not clock.group(0):
            raise ValueError(f"invalid wall-clock duration {timestring!r}: give hours, minutes and seconds "
                             f"such as '1h20m40s'")
        hours, minutes, seconds = (int(clock[k] or 0) for k in "hms")
        return cls(hours * 3600 + minutes * 60 + seconds, TimeUnit.SECOND)

    @classmethod
    def from_second(cls, second: int) -> Time:
        return cls(second, TimeUnit.SECOND)

    @classmethod
    def from_epoch(cls, epoch: int) -> Time:
        return cls(epoch, TimeUnit.EPOCH)

    @classmethod
    def from_batch(cls, batch: int) -> Time:
        return cls(batch, TimeUnit.BATCH)

    @classmethod
    def from_sample(cls, sample: int) -> Time:
        return cls(sample, TimeUnit.SAMPLE)

    @classmethod
    def from_token(cls, token: int) -> Time:
        return cls(token, TimeUnit.TOKEN)

    @classmethod
    def from_duration(cls, duration: float) -> Time:
        return cls(duration, TimeUnit.DURATION)

    @classmethod
    def from_input(cls, i: Time | str | int | float, default_int_unit: TimeUnit | str | None = None, *,
                   default_unit: TimeUnit | str | None = None) -> Time:
        """A Time, a duration string, or a number counted in ``default_int_unit`` (Composer's name;
        ``default_unit`` is lockstep's older one)."""
        if isinstance(i, Time):
            return i
        if isinstance(i, str):
            return cls.from_timestring(i)
        unit = default_int_unit if default_int_unit is not None else default_unit
        if isinstance(i, (int, float)) and not isinstance(i, bool):
            if unit is None:
                raise TimeTypeError(f"got the number {i} without a unit: write it as a string "
                                    f"such as '{i}ep' or '{i}ba'")
            return cls(i, TimeUnit(unit))
        raise TimeTypeError(f"expected a Time, a duration string such as '2ep', or an int; "
                            f"got {type(i).__name__}")

    def to_timestring(self) -> str:
        return str(self)

    def require_positive(self, name: str) -> Time:
        """Return self if the value is above zero; otherwise raise ValueError naming ``name``."""
        if self.value <= 0:
            raise ValueError(f"{name} must be positive, got '{self}'")
        return self

    def __str__(self) -> str:
        return f"{self.value}{self.unit.value}"

    def __repr__(self) -> str:
        return f"Time({self.value}, TimeUnit.{self.unit.name})"

    def __format__(self, spec: str) -> str:
        """``f"{t}"`` is ``'10ba'``; with a format spec (``f"{t:,}"``) the value is formatted."""
        return str(self) if not spec else format(self.value, spec)

    def __int__(self) -> int:
        return int(self.value)

    def __float__(self) -> float:
        return float(self.value)

    def __hash__(self) -> int:
        # as its value's: a Time equals the plain number (``Time(3, 'ba') == 3``), so
        # ``state.timestamp.batch in {3, 6}`` finds it (Composer hashes the unit in too)
        return hash(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)

    def _other(self, other: object, verb: str) -> Time:
        """``other`` as a Time of this unit (a number is taken in it); RuntimeError for another unit."""
        if isinstance(other, Time):
            time = other
        elif isinstance(other, str):
            time = Time.from_timestring(other)
        else:
            return Time(other, self.unit)  # type: ignore[arg-type]  # a number: the callers checked
        if time.unit is not self.unit:
            raise RuntimeError(f"cannot {verb} '{self}' and '{time}': units '{self.unit.value}' and "
                               f"'{time.unit.value}' differ")
        return time

    def _value_of(self, other: object, verb: str) -> Any:
        """The value to set against this one, or NotImplemented for what a Time does not mix with."""
        if type(other) is int or type(other) is float:  # the Trainer's and callbacks' common case
            return other
        if isinstance(other, (Time, str)) or (isinstance(other, (int, float)) and not isinstance(other, bool)):
            return self._other(other, verb).value
        return NotImplemented

    def __eq__(self, other: object) -> bool:
        value = self._value_of(other, "compare")
        return value if value is NotImplemented else self.value == value

    def __ne__(self, other: object) -> bool:
        value = self._value_of(other, "compare")
        return value if value is NotImplemented else self.value != value

    def __lt__(self, other: object) -> bool:
        value = self._value_of(other, "compare")
        return value if value is NotImplemented else self.value < value

    def __le__(self, other: object) -> bool:
        value = self._value_of(other, "compare")
        return value if value is NotImplemented else self.value <= value

    def __gt__(self, other: object) -> bool:
        value = self._value_of(other, "compare")
        return value if value is NotImplemented else self.value > value

    def __ge__(self, other: object) -> bool:
        value = self._value_of(other, "compare")
        return value if value is NotImplemented else self.value >= value

    def __add__(self, other: object) -> Time:
        value = self._value_of(other, "add")
        return value if value is NotImplemented else Time(self.value + value, self.unit)

    __radd__ = __add__

    def __sub__(self, other: object) -> Time:
        value = self._value_of(other, "subtract")
        return value if value is NotImplemented else Time(self.value - value, self.unit)

    def __rsub__(self, other: object) -> Time:
        value = self._value_of(other, "subtract")
        return value if value is NotImplemented else Time(value - self.value, self.unit)

    def __neg__(self) -> Time:
        return Time(-self.value, self.unit)

    def __pos__(self) -> Time:
        return self

    def __mod__(self, other: object) -> Time:
        value = self._value_of(other, "take the remainder of")
        return value if value is NotImplemented else Time(self.value % value, self.unit)

    def __mul__(self, other: object) -> Time:
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Time(type(self.value)(self.value * other), self.unit)
        if not isinstance(other, (Time, str)):
            return NotImplemented
        time = other if isinstance(other, Time) else Time.from_timestring(other)
        if TimeUnit.DURATION not in (self.unit, time.unit):
            raise RuntimeError(f"cannot multiply '{self}' by '{time}': one of them must be in 'dur'")
        unit = self.unit if time.unit is TimeUnit.DURATION else time.unit
        product = self.value * time.value
        return Time(product if unit is TimeUnit.DURATION else int(product), unit)

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Time:
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Time(type(self.value)(self.value / other), self.unit)
        if not isinstance(other, (Time, str)):
            return NotImplemented
        return Time(self.value / self._other(other, "divide").value, TimeUnit.DURATION)


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> Time:
    return Time._parse_string(text)


def ensure_time(maybe_time: Time | str | int, int_unit: TimeUnit | str) -> Time:
    """``maybe_time`` as a Time, a number counted in ``int_unit`` (Composer's helper)."""
    return Time.from_input(maybe_time, int_unit)


_COUNTS = ("_iteration", "_epoch", "_batch", "_sample", "_token", "_epoch_in_iteration", "_token_in_iteration",
           "_batch_in_epoch", "_sample_in_epoch", "_token_in_epoch")
_CLOCKS = ("_total_wct", "_iteration_wct", "_epoch_wct", "_batch_wct")
_UNIT_OF_COUNT = {"iteration": TimeUnit.ITERATION, "epoch": TimeUnit.EPOCH, "batch": TimeUnit.BATCH, "sample": TimeUnit.SAMPLE,
                  "token": TimeUnit.TOKEN, "epoch_in_iteration": TimeUnit.EPOCH,
                  "token_in_iteration": TimeUnit.TOKEN, "batch_in_epoch": TimeUnit.BATCH,
                  "sample_in_epoch": TimeUnit.SAMPLE, "token_in_epoch": TimeUnit.TOKEN}


class _Count:
    # A Timestamp's count, read as a Time: one frame and three C calls, since callbacks (and the
    # Trainer) read counts every batch. (No class docstring: each instance has its own __doc__.)

    __slots__ = ("slot", "unit", "__doc__")

    def __init__(self, slot: str, unit: TimeUnit, doc: str) -> None:
        self.slot, self.unit, self.__doc__ = slot, unit, doc

    def __get__(self, timestamp: Timestamp | None, owner: type | None = None) -> Any:
        if timestamp is None:
            return self
        time = _new_time(Time)  # the count was checked when it was set: no constructor checks again
        _set(time, "value", getattr(timestamp, self.slot))
        _set(time, "unit", self.unit)
        return time

    def __set__(self, timestamp: Timestamp, value: int | Time) -> None:
        """Composer lets a count be set in place (``timestamp.epoch_in_iteration = 2``)."""
        _set(timestamp, self.slot, _count_argument(self.slot[1:], value))

    @staticmethod
    def make(value: int, unit: TimeUnit) -> Time:
        time = _new_time(Time)
        _set(time, "value", value)
        _set(time, "unit", unit)
        return time


class Timestamp:
    """Training progress, as in Composer: each count is a :class:`Time` (``timestamp.batch ==
    Time(3, 'ba')``, ``== 3`` too), the wall-clock fields ``datetime.timedelta``.

    ``epoch``, ``batch``, ``sample``, ``token`` count the whole run; ``batch_in_epoch``,
    ``sample_in_epoch``, ``token_in_epoch`` the current epoch. ``sample`` and ``token`` are summed
    over all ranks. A run is one iteration (``iteration`` stays 0 unless set). Every update
    (:meth:`to_next_batch`, :meth:`to_next_epoch`, :meth:`copy`) returns a new Timestamp.
    """

    __slots__ = _COUNTS + _CLOCKS

    def __init__(self, iteration: int | Time = 0, epoch: int | Time = 0, batch: int | Time = 0,
                 sample: int | Time = 0, token: int | Time = 0, epoch_in_iteration: int | Time | None = None,
                 token_in_iteration: int | Time | None = None, batch_in_epoch: int | Time = 0,
                 sample_in_epoch: int | Time = 0, token_in_epoch: int | Time = 0,
                 total_wct: datetime.timedelta | None = None, iteration_wct: datetime.timedelta | None = None,
                 epoch_wct: datetime.timedelta | None = None, batch_wct: datetime.timedelta | None = None) -> None:
        given = {"iteration": iteration, "epoch": epoch, "batch": batch, "sample": sample, "token": token,
                 # one iteration by default: its epochs and tokens are the run's
                 "epoch_in_iteration": epoch if epoch_in_iteration is None else epoch_in_iteration,
                 "token_in_iteration": token if token_in_iteration is None else token_in_iteration,
                 "batch_in_epoch": batch_in_epoch, "sample_in_epoch": sample_in_epoch,
                 "token_in_epoch": token_in_epoch}
        for name, value in given.items():
            _set(self, "_" + name, _count_argument(name, value))
        for name, clock in zip(_CLOCKS, (total_wct, iteration_wct, epoch_wct, batch_wct)):
            _set(self, name, _seconds(name[1:], clock))

    def _time(self, name: str, unit: TimeUnit) -> Time:
        return _Count.make(getattr(self, name), unit)

    iteration = _Count("_iteration", TimeUnit.ITERATION, "Iterations done: a lockstep run is one, so 0 unless given.")
    epoch = _Count("_epoch", TimeUnit.EPOCH, "Epochs done in the run.")
    batch = _Count("_batch", TimeUnit.BATCH, "Batches (optimizer steps) done.")
    sample = _Count("_sample", TimeUnit.SAMPLE, "Samples trained on, over all ranks.")
    token = _Count("_token", TimeUnit.TOKEN, "Tokens trained on, over all ranks.")
    epoch_in_iteration = _Count("_epoch_in_iteration", TimeUnit.EPOCH, "Epochs done in this iteration.")
    token_in_iteration = _Count("_token_in_iteration", TimeUnit.TOKEN, "Tokens trained on in this iteration.")
    batch_in_epoch = _Count("_batch_in_epoch", TimeUnit.BATCH, "Batches done in the current epoch.")
    sample_in_epoch = _Count("_sample_in_epoch", TimeUnit.SAMPLE, "Samples trained on in the current epoch.")
    token_in_epoch = _Count("_token_in_epoch", TimeUnit.TOKEN, "Tokens trained on in the current epoch.")
    total_wct = property(lambda self: datetime.timedelta(seconds=self._total_wct),
                         doc="Wall-clock time the batches of the run took.")
    iteration_wct = property(lambda self: datetime.timedelta(seconds=self._iteration_wct))
    epoch_wct = property(lambda self: datetime.timedelta(seconds=self._epoch_wct),
                         doc="Wall-clock time the batches of this epoch took.")
    batch_wct = property(lambda self: datetime.timedelta(seconds=self._batch_wct),
                         doc="Wall-clock time the last batch took.")

    def get(self, unit: TimeUnit | str) -> Time:
        """The count in ``unit`` (``ep ba sp tok``) as a Time."""
        name = _COUNT_OF.get(unit)  # a lookup, not an enum call
        if name is None:  # 'dur', or not a unit at all: TimeUnit() names what is wrong
            TimeUnit(unit)
            raise ValueError("a Timestamp has no 'dur' count; use fraction_done(timestamp, max_duration)")
        if name == "_total_wct":
            return Time(int(self._total_wct), TimeUnit.SECOND)
        return self._time(name, TimeUnit(unit))

    def to_next_batch(self, samples: int | Time = 0, tokens: int | Time = 0,
                      duration: datetime.timedelta | float | None = None) -> Timestamp:
        """The timestamp after one more batch of ``samples`` and ``tokens`` (all ranks) that took
        ``duration`` (a timedelta, or seconds)."""
        if type(samples) is not int or type(tokens) is not int:
            samples, tokens = _count_argument("samples", samples), _count_argument("tokens", tokens)
        if samples < 0 or tokens < 0:
            raise ValueError(f"samples and tokens must be >= 0, got samples={samples}, tokens={tokens}")
        seconds = _seconds("duration", duration) if type(duration) is not float else duration
        # Sums of checked ints need no checking again: the fields are set directly, past the
        # constructor (this runs every batch, with the caches cold).
        after = _new_timestamp(Timestamp)
        _set(after, "_iteration", self._iteration)
        _set(after, "_epoch", self._epoch)
        _set(after, "_batch", self._batch + 1)
        _set(after, "_sample", self._sample + samples)
        _set(after, "_token", self._token + tokens)
        _set(after, "_epoch_in_iteration", self._epoch_in_iteration)
        _set(after, "_token_in_iteration", self._token_in_iteration + tokens)
        _set(after, "_batch_in_epoch", self._batch_in_epoch + 1)
        _set(after, "_sample_in_epoch", self._sample_in_epoch + samples)
        _set(after, "_token_in_epoch", self._token_in_epoch + tokens)
        _set(after, "_total_wct", self._total_wct + seconds)
        _set(after, "_iteration_wct", self._iteration_wct + seconds)
        _set(after, "_epoch_wct", self._epoch_wct + seconds)
        _set(after, "_batch_wct", seconds)
        return after

    def to_next_epoch(self, duration: datetime.timedelta | float | None = None) -> Timestamp:
        """The timestamp after the end of this epoch: the in-epoch counts start over."""
        seconds = _seconds("duration", duration)
        return self._copied(_epoch=self._epoch + 1, _epoch_in_iteration=self._epoch_in_iteration + 1,
                            _batch_in_epoch=0, _sample_in_epoch=0, _token_in_epoch=0,
                            _total_wct=self._total_wct + seconds, _iteration_wct=self._iteration_wct + seconds,
                            _epoch_wct=0.0, _batch_wct=0.0)

    def to_next_iteration(self, duration: datetime.timedelta | float | None = None) -> Timestamp:
        """The timestamp after the end of this iteration (Composer's; lockstep runs are one)."""
        seconds = _seconds("duration", duration)
        return self._copied(_iteration=self._iteration + 1, _epoch_in_iteration=0, _token_in_iteration=0,
                            _batch_in_epoch=0, _sample_in_epoch=0, _token_in_epoch=0,
                            _total_wct=self._total_wct + seconds, _iteration_wct=0.0, _epoch_wct=0.0,
                            _batch_wct=0.0)

    def copy(self, **changes: Any) -> Timestamp:
        """A copy with the fields named in ``changes`` (Composer's keyword names) replaced."""
        unknown = changes.keys() - set(TIMESTAMP_KEYS)
        if unknown:
            raise TypeError(f"Timestamp.copy() got unknown fields {sorted(unknown)}; the fields are {list(TIMESTAMP_KEYS)}")
        return Timestamp(**{**self._fields(), **changes})

    def _copied(self, **slots: Any) -> Timestamp:
        copy = _new_timestamp(Timestamp)
        for name in Timestamp.__slots__:
            _set(copy, name, slots[name] if name in slots else getattr(self, name))
        return copy

    def _fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {name[1:]: getattr(self, name) for name in _COUNTS}
        fields.update({name[1:]: datetime.timedelta(seconds=getattr(self, name)) for name in _CLOCKS})
        return fields

    def state_dict(self) -> dict[str, Any]:
        """Composer's form: each count as an int, the wall-clock fields as timedeltas."""
        return self._fields()

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Timestamp:
        """Rebuild a Timestamp from :meth:`state_dict` (Composer's or lockstep's older seven
        counts); a count missing, unknown or not an int is an error."""
        if not isinstance(state, dict):
            raise TypeError(f"a Timestamp state_dict must be a dict, got {type(state).__name__}")
        missing, unknown = set(TIMESTAMP_FIELDS) - state.keys(), state.keys() - set(TIMESTAMP_KEYS)
        if missing or unknown:
            raise ValueError(f"invalid Timestamp state_dict: missing keys {sorted(missing)}, "
                             f"unknown keys {sorted(map(str, unknown))}; expected {sorted(TIMESTAMP_FIELDS)} "
                             f"and optionally {sorted(set(TIMESTAMP_KEYS) - set(TIMESTAMP_FIELDS))}")
        try:
            # operator.index also accepts numpy integers and 0-d integer tensors from a checkpoint
            counts = {name: operator.index(state[name]) for name in _COUNTED_KEYS if name in state}
        except TypeError:
            raise ValueError(f"invalid Timestamp state_dict: counts must be ints, got {state!r}") from None
        clocks = {name[1:]: state[name[1:]] for name in _CLOCKS if name[1:] in state}
        return cls(**counts, **clocks)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Composer's in-place load of :meth:`state_dict`."""
        loaded = Timestamp.from_state_dict(state)
        for name in Timestamp.__slots__:
            _set(self, name, getattr(loaded, name))

    def _counts(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in _COUNTS)

    def __eq__(self, other: object) -> bool:
        """Timestamps: equal counts (and clocks, as in Composer). A Time or a duration string: the
        count in its unit equals it."""
        if isinstance(other, Timestamp):
            return all(getattr(self, n) == getattr(other, n) for n in Timestamp.__slots__)
        if isinstance(other, (Time, str)):
            time = Time.from_input(other)
            return self.get(time.unit) == time
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._counts())

    def _compare(self, other: object, op: Callable[[Any, Any], bool]) -> bool:
        if not isinstance(other, (Time, str)):
            return NotImplemented
        time = Time.from_input(other)
        return op(self.get(time.unit), time)

    def __lt__(self, other: object) -> bool:
        return self._compare(other, operator.lt)

    def __le__(self, other: object) -> bool:
        return self._compare(other, operator.le)

    def __gt__(self, other: object) -> bool:
        return self._compare(other, operator.gt)

    def __ge__(self, other: object) -> bool:
        return self._compare(other, operator.ge)

    def __repr__(self) -> str:
        counts = ", ".join(f"{name[1:]}={getattr(self, name)}" for name in _COUNTS)
        clocks = ", ".join(f"{name[1:]}={datetime.timedelta(seconds=getattr(self, name))!r}" for name in _CLOCKS)
        return f"Timestamp({counts}, {clocks})"


def _count_argument(name: str, value: int | Time) -> int:
    """A count given to a Timestamp, as an int: an int, or a Time in the count's unit."""
    if isinstance(value, Time):
        unit = _UNIT_OF_COUNT.get(name)
        if unit is not None and value.unit is not unit:
            raise ValueError(f"Timestamp.{name} is counted in '{unit.value}', got '{value}'")
        value = value.value
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)) or value < 0:
        raise ValueError(f"Timestamp.{name} must be a non-negative int, got {value!r}")
    return int(value)


def _seconds(name: str, value: datetime.timedelta | float | None) -> float:
    if value is None:
        return 0.0
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"Timestamp.{name} must be a datetime.timedelta, got {type(value).__name__}")


_new_timestamp, _new_time, _set = object.__new__, object.__new__, object.__setattr__

# a StrEnum member hashes and compares as its value: "ba" finds TimeUnit.BATCH here
_COUNT_OF: dict[TimeUnit | str, str] = {TimeUnit.EPOCH: "_epoch", TimeUnit.BATCH: "_batch",
                                        TimeUnit.SAMPLE: "_sample", TimeUnit.TOKEN: "_token",
                                        TimeUnit.SECOND: "_total_wct", TimeUnit.ITERATION: "_iteration"}

TIMESTAMP_FIELDS = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
"""The counts of training progress that a checkpoint must hold."""
TIMESTAMP_KEYS = tuple(name[1:] for name in _COUNTS + _CLOCKS)
"""Every key of :meth:`Timestamp.state_dict`, in Composer's order."""
_COUNTED_KEYS = tuple(name[1:] for name in _COUNTS)


def count(timestamp: Timestamp, unit: TimeUnit | str) -> int:
    """The count of ``timestamp`` in ``unit`` (``ep ba sp tok``) as an int, for the loop's checks."""
    name = _COUNT_OF.get(unit)
    if name is None:
        timestamp.get(unit)  # raises, saying why
    return getattr(timestamp, name)  # type: ignore[arg-type]


def time_argument(name: str, value: Time | str | int) -> Time:
    """Parse the argument ``name`` (an int counts epochs, as in Composer) and check it is positive;
    an error names the argument."""
    try:
        time = Time.from_input(value, TimeUnit.EPOCH)
        if time.unit is TimeUnit.ITERATION:
            raise ValueError("a lockstep run is one iteration: give it in ep, ba, sp, tok or dur")
        _check_duration(time.value, time.unit)
        return time.require_positive(name)
    except (TypeError, ValueError) as e:
        # named already ('duration must be ...'), but not by a word that starts alike ('durations cannot ...')
        message = str(e) if str(e).startswith((f"{name} ", f"{name}=")) else f"{name}={value!r}: {e}"
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
    return count(timestamp, unit) >= amount


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
    interval = time_argument("interval", interval)
    unit, step = _resolve(interval, max_duration, "interval")
    if step <= 0:  # as in Composer, an empty interval is never due
        return False
    return count(timestamp_after, unit) // step > count(timestamp_before, unit) // step


def _whole_count(duration: Time | str, max_duration: Time | str | None) -> bool:
    """Whether ``duration`` is already a Time counted in ``ep ba sp tok`` and ``max_duration`` needs
    no checking: then a Timestamp's attribute answers without parsing or resolving anything."""
    return (type(duration) is Time and duration.unit in _COUNT_OF
            and (max_duration is None or type(max_duration) is Time and max_duration.unit in _COUNT_OF))


def fraction_done(timestamp: Timestamp, max_duration: Time | str, *,
                  batches_per_epoch: int | None = None) -> float:
    """Return the share of ``max_duration`` done, in [0, 1], for progress bars and ETAs.

    With an ``ep`` max_duration, ``batches_per_epoch`` (when known) adds progress within the epoch.
    """
    max_duration = check_max_duration(max_duration)
    done = float(count(timestamp, max_duration.unit))
    if max_duration.unit is TimeUnit.EPOCH and batches_per_epoch:
        done += min(timestamp._batch_in_epoch / batches_per_epoch, 1.0)
    return min(done / max_duration.value, 1.0)
