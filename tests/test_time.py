"""Tests for lockstep.time: the duration grammar, Time and Timestamp with Composer's semantics,
and the trainer helpers."""

from __future__ import annotations

import datetime

import pytest

from lockstep.time import (
    TIMESTAMP_FIELDS,
    Time,
    Timestamp,
    TimeUnit,
    check_max_duration,
    fraction_done,
    is_interval_due,
    is_reached,
)
from lockstep.time import ensure_time


@pytest.mark.parametrize(
    ("text", "value", "unit"),
    [
        ("160ep", 160, TimeUnit.EPOCH),
        ("2ba", 2, TimeUnit.BATCH),
        ("1000sp", 1000, TimeUnit.SAMPLE),
        ("3e4tok", 30000, TimeUnit.TOKEN),
        ("1e6tok", 1_000_000, TimeUnit.TOKEN),
        ("0.5dur", 0.5, TimeUnit.DURATION),
        ("1_000sp", 1000, TimeUnit.SAMPLE),
        ("  2ep\n", 2, TimeUnit.EPOCH),
        ("0ep", 0, TimeUnit.EPOCH),
        ("1dur", 1.0, TimeUnit.DURATION),
        ("2.0ba", 2, TimeUnit.BATCH),
        ("1.5e1ep", 15, TimeUnit.EPOCH),
        (".25dur", 0.25, TimeUnit.DURATION),
    ],
)
def test_from_string_parses_every_unit(text: str, value: int | float, unit: TimeUnit) -> None:
    time = Time.from_string(text)
    assert time.value == value
    assert type(time.value) is (float if unit is TimeUnit.DURATION else int)
    assert time.unit is unit


@pytest.mark.parametrize(
    "text", ["2x", "ep", "", "abc", "1.5ba", "1.5ep", "-1ep", "-0.5dur", "1__0sp",
             "_1sp", "1e-1tok", "2 ep", "nanep", "infdur", "1e9999tok"],
)
def test_from_string_rejects_bad_input_quoting_it(text: str) -> None:
    with pytest.raises(ValueError) as info:
        Time.from_string(text)
    message = str(info.value)
    assert repr(text) in message
    assert "ep, ba, sp, tok, dur" in message and "'0.5dur'" in message


def test_error_messages_say_why() -> None:
    with pytest.raises(ValueError, match="whole numbers"):
        Time.from_string("1.5ba")
    with pytest.raises(ValueError, match="negative"):
        Time.from_string("-1ep")
    assert Time.from_string("1.25dur").value == 1.25  # as in Composer: a schedule may outlast the run
    assert Time.from_string("0dur").value == 0.0
    assert str(_error(Time.from_string, "2x")) == (
        "invalid duration '2x': expected a number followed by one of ep, ba, sp, tok, dur, iter, sec "
        "(e.g. '2ep', '100ba', '0.5dur'), or hours, minutes and seconds such as '1h20m40s'"
    )


def _error(fn, *args) -> ValueError:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("text", ["160ep", "2ba", "1000sp", "30000tok", "0.5dur", "1.0dur", "0ep"])
def test_str_round_trips(text: str) -> None:
    assert str(Time.from_string(text)) == text
    assert Time.from_string(str(Time.from_string(text))) == Time.from_string(text)
    assert Time.from_timestring(text) == Time.from_string(text)
    assert Time.from_string(text).to_timestring() == text


def test_repr_is_composers() -> None:
    assert repr(Time(160, "ep")) == "Time(160, TimeUnit.EPOCH)"
    assert repr(Time(0.5, TimeUnit.DURATION)) == "Time(0.5, TimeUnit.DURATION)"


def test_constructor_validates_and_coerces_the_unit() -> None:
    assert Time(2, "ep") == Time(2, TimeUnit.EPOCH)
    assert Time(1, "dur").value == 1.0 and type(Time(1, "dur").value) is float
    with pytest.raises(TypeError, match="'ba' counts whole batches, got 1.5"):
        Time(1.5, "ba")
    assert Time(-2, "ep").value == -2  # as in Composer: a difference of times may be negative
    with pytest.raises(ValueError, match="invalid time unit 'epochs'"):
        Time(2, "epochs")
    with pytest.raises(TypeError):
        Time(True, "ep")
    assert Time.from_epoch(3) == Time(3, "ep") and Time.from_batch(3) == Time(3, "ba")
    assert Time.from_sample(3) == Time(3, "sp") and Time.from_token(3) == Time(3, "tok")
    assert Time.from_duration(0.5) == Time(0.5, "dur") and Time[int] is not None


def test_time_is_immutable_and_hashable() -> None:
    time = Time.from_string("2ep")
    with pytest.raises(AttributeError):
        time.value = 3  # type: ignore[misc]
    assert {time: 1}[Time(2, "ep")] == 1


def test_from_input() -> None:
    time = Time.from_string("2ep")
    assert Time.from_input(time) is time
    assert Time.from_input("2ep") == time
    assert Time.from_input(2, default_unit="ep") == time
    assert Time.from_input(2, default_unit=TimeUnit.EPOCH) == time
    assert Time.from_input(2, "ep") == time and Time.from_input(0.5, TimeUnit.DURATION) == Time(0.5, "dur")
    assert ensure_time(2, "ep") == time and ensure_time("2ep", "ba") == time
    with pytest.raises(ValueError, match="'2ep'"):
        Time.from_input(2)
    with pytest.raises(TypeError):
        Time.from_input(2.5, "ep")
    with pytest.raises(TypeError):
        Time.from_input(True, default_unit="ep")


def test_require_positive_names_the_argument() -> None:
    assert Time.from_string("1ba").require_positive("max_duration") == Time(1, "ba")
    with pytest.raises(ValueError, match=r"^max_duration must be positive, got '0ep'$"):
        Time.from_string("0ep").require_positive("max_duration")


def test_comparisons_within_a_unit() -> None:
    one, two = Time.from_string("1ba"), Time.from_string("2ba")
    assert one < two and one <= two and two > one and two >= one and one <= one
    assert one == Time(1, "ba") and one != two
    assert Time.from_string("0.25dur") < Time.from_string("0.5dur")
    assert sorted([two, one]) == [one, two]


def test_comparing_different_units_raises_naming_both() -> None:
    with pytest.raises(RuntimeError, match="'ep' and 'ba'"):
        Time.from_string("1ep") < Time.from_string("2ba")  # noqa: B015
    with pytest.raises(RuntimeError, match="'sp' and 'tok'"):
        Time.from_string("1sp") >= Time.from_string("2tok")  # noqa: B015
    with pytest.raises(RuntimeError):
        Time.from_string("1ep") == Time.from_string("1ba")  # noqa: B015  # as in Composer
    assert Time(1, "ep") != None and Time(1, "ep") != [1]  # noqa: E711 - other types are not equal


def test_numbers_and_strings_are_taken_in_the_times_unit() -> None:
    ten = Time(10, "ba")
    assert ten == 10 and 10 == ten and ten != 11 and ten < 11 and ten >= 10 and not ten > 10
    assert ten == "10ba" and ten < "1e2ba"
    assert ten + 5 == Time(15, "ba") and 5 + ten == Time(15, "ba") and ten + "2ba" == 12
    assert ten - 3 == 7 and 30 - ten == Time(20, "ba") and -ten == Time(-10, "ba") and +ten == ten
    assert int(ten) == 10 and float(ten) == 10.0 and ten % 3 == Time(1, "ba")
    assert Time(0.5, "dur") < 0.75
    with pytest.raises(RuntimeError):
        ten + "1ep"


def test_multiplying_and_dividing() -> None:
    assert Time(4, "ep") * 0.5 == Time(2, "ep") and 0.5 * Time(4, "ep") == Time(2, "ep")
    assert Time(4, "ep") * Time(0.25, "dur") == Time(1, "ep")
    assert Time(0.5, "dur") * Time(10, "ba") == Time(5, "ba")
    assert Time(4, "ep") / 2 == Time(2, "ep")
    assert Time(4, "ep") / Time(2, "ep") == Time(2.0, "dur")
    with pytest.raises(RuntimeError, match="'dur'"):
        Time(4, "ep") * Time(2, "ep")
    with pytest.raises(RuntimeError):
        Time(4, "ep") / Time(2, "ba")


def test_add_and_subtract() -> None:
    assert Time.from_string("2ep") + Time.from_string("3ep") == Time(5, "ep")
    assert Time.from_string("5sp") - Time.from_string("5sp") == Time(0, "sp")
    assert Time.from_string("0.25dur") + Time.from_string("0.5dur") == Time(0.75, "dur")
    assert Time.from_string("1ba") - Time.from_string("2ba") == Time(-1, "ba")
    with pytest.raises(RuntimeError, match="'ep' and 'ba'"):
        Time.from_string("1ep") + Time.from_string("1ba")


def test_timestamp_arithmetic() -> None:
    start = Timestamp()
    after = start.to_next_batch(samples=16, tokens=128).to_next_batch(samples=8)
    assert start == Timestamp()  # updates return new timestamps
    assert (after.batch, after.sample, after.token) == (2, 24, 128)
    assert (after.batch_in_epoch, after.sample_in_epoch, after.token_in_epoch) == (2, 24, 128)
    next_epoch = after.to_next_epoch()
    assert next_epoch == Timestamp(epoch=1, batch=2, sample=24, token=128)
    assert [next_epoch.get(unit) for unit in ("ep", "ba", "sp", "tok")] == [1, 2, 24, 128]
    assert [next_epoch.get(unit) for unit in (TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN)] \
        == [1, 2, 24, 128]
    with pytest.raises(ValueError, match="fraction_done"):
        next_epoch.get("dur")
    with pytest.raises(ValueError):
        start.to_next_batch(samples=-1)
    with pytest.raises(ValueError, match="Timestamp.batch"):
        Timestamp(batch=-1)
    changed = Timestamp()
    changed.epoch_in_iteration = 2  # as in Composer, a count can be set in place, and is checked
    assert changed.epoch_in_iteration == 2 and changed.batch == 0
    with pytest.raises(ValueError, match="non-negative"):
        changed.batch = -1  # type: ignore[assignment]


def test_timestamp_fields_are_times() -> None:
    timestamp = Timestamp(epoch=1, batch=Time(7, "ba"), sample=70, token=700, batch_in_epoch=3)
    assert timestamp.batch == Time(7, "ba") and timestamp.batch.value == 7 and timestamp.batch.unit is TimeUnit.BATCH
    assert isinstance(timestamp.epoch, Time) and timestamp.batch_in_epoch == Time(3, "ba")
    assert timestamp.get("sp") == Time(70, "sp") and timestamp.iteration == Time(0, "iter")
    assert timestamp >= "7ba" and timestamp < "701tok" and timestamp == Time(1, "ep")
    with pytest.raises(ValueError, match="counted in 'ba'"):
        Timestamp(batch=Time(2, "ep"))
    assert timestamp.copy(batch=8).batch == 8 and timestamp.batch == 7


def test_timestamp_tracks_wall_clock_as_composer() -> None:
    after = Timestamp().to_next_batch(4, duration=datetime.timedelta(seconds=2)).to_next_batch(4, duration=1.0)
    assert after.total_wct == datetime.timedelta(seconds=3) and after.batch_wct == datetime.timedelta(seconds=1)
    assert after.epoch_wct == datetime.timedelta(seconds=3)
    next_epoch = after.to_next_epoch()
    assert next_epoch.epoch_wct == datetime.timedelta(0) and next_epoch.total_wct == datetime.timedelta(seconds=3)


def test_to_next_batch_sets_every_count_and_still_checks_its_input() -> None:
    """to_next_batch sets the fields itself, past the constructor: every field, the right sums."""
    import numpy as np

    middle = Timestamp(epoch=2, batch=5, sample=40, token=9, batch_in_epoch=1, sample_in_epoch=8, token_in_epoch=3)
    after = middle.to_next_batch(16, 4)
    assert after == Timestamp(epoch=2, batch=6, sample=56, token=13, batch_in_epoch=2, sample_in_epoch=24,
                              token_in_epoch=7)
    assert {name: after.state_dict()[name] for name in TIMESTAMP_FIELDS} == \
        {name: getattr(after, name).value for name in TIMESTAMP_FIELDS}
    assert hash(after) == hash(Timestamp(**after.state_dict())) and after.to_next_epoch().epoch == 3
    with pytest.raises(ValueError, match="must be a non-negative int"):
        middle.to_next_batch(np.int64(16))
    with pytest.raises(ValueError, match="must be a non-negative int"):
        middle.to_next_batch(16, 2.0)


def test_timestamp_state_dict_round_trip() -> None:
    timestamp = Timestamp().to_next_batch(4, 40).to_next_epoch().to_next_batch(4, 12)
    state = timestamp.state_dict()
    zero = datetime.timedelta(0)
    assert state == {"iteration": 0, "epoch": 1, "batch": 2, "sample": 8, "token": 52, "epoch_in_iteration": 1,
                     "token_in_iteration": 52, "batch_in_epoch": 1, "sample_in_epoch": 4, "token_in_epoch": 12,
                     "total_wct": zero, "iteration_wct": zero, "epoch_wct": zero, "batch_wct": zero}
    assert Timestamp.from_state_dict(state) == timestamp
    restored = Timestamp()
    restored.load_state_dict(state)  # Composer's in-place form
    assert restored == timestamp
    older = {name: state[name] for name in TIMESTAMP_FIELDS}  # lockstep's checkpoints before Composer's keys
    assert Timestamp.from_state_dict(older) == timestamp


def test_timestamp_from_state_dict_validates_keys() -> None:
    state = Timestamp().state_dict()
    del state["token"]
    with pytest.raises(ValueError, match=r"missing keys \['token'\]"):
        Timestamp.from_state_dict(state)
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        Timestamp.from_state_dict({**Timestamp().state_dict(), "extra": 1})
    with pytest.raises(ValueError, match="must be ints"):
        Timestamp.from_state_dict({**Timestamp().state_dict(), "batch": 1.5})


def test_max_duration_in_dur_is_refused() -> None:
    message = "max_duration cannot be in 'dur'"
    with pytest.raises(ValueError, match=message):
        check_max_duration("0.5dur")
    with pytest.raises(ValueError, match=message):
        is_reached(Timestamp(), "0.5dur", max_duration="0.5dur")
    with pytest.raises(ValueError, match=message):
        is_interval_due(Timestamp(), Timestamp(batch=1), "1ba", max_duration="0.5dur")
    with pytest.raises(ValueError, match=message):
        fraction_done(Timestamp(), "1dur")
    with pytest.raises(ValueError, match="max_duration must be positive, got '0ba'"):
        check_max_duration("0ba")
    assert check_max_duration("2ep") == Time(2, "ep")


def _steps_until_reached(max_duration: str, batch: int, dataset: int) -> int:
    """Simulate the trainer: run batches of ``batch`` samples until max_duration is reached."""
    timestamp, steps = Timestamp(), 0
    while not is_reached(timestamp, max_duration):
        for start in range(0, dataset, batch):
            timestamp = timestamp.to_next_batch(samples=min(batch, dataset - start))
            steps += 1
            if is_reached(timestamp, max_duration):
                return steps
        timestamp = timestamp.to_next_epoch()
    return steps


def test_stops_at_first_batch_boundary_reaching_the_limit() -> None:
    assert _steps_until_reached("40sp", batch=16, dataset=64) == 3  # 48 >= 40
    assert _steps_until_reached("48sp", batch=16, dataset=64) == 3
    assert _steps_until_reached("2ep", batch=16, dataset=64) == 8
    assert _steps_until_reached("5ba", batch=16, dataset=64) == 5


def test_is_reached_per_unit() -> None:
    timestamp = Timestamp(epoch=1, batch=6, sample=96, token=960)
    assert is_reached(timestamp, "1ep") and not is_reached(timestamp, "2ep")
    assert is_reached(timestamp, "6ba") and not is_reached(timestamp, "7ba")
    assert is_reached(timestamp, "96sp") and not is_reached(timestamp, "97sp")
    assert is_reached(timestamp, "960tok") and not is_reached(timestamp, "1e3tok")
    assert is_reached(timestamp, Time(0, "ba"))


def test_is_reached_with_dur() -> None:
    assert is_reached(Timestamp(batch=4), "0.5dur", max_duration="8ba")
    assert not is_reached(Timestamp(batch=3), "0.5dur", max_duration="8ba")
    # 0.1 * 30 in binary floats is 3.0000000000000004; the user meant exactly 3 batches
    assert is_reached(Timestamp(batch=3), "0.1dur", max_duration="30ba")
    with pytest.raises(ValueError, match="max_duration is needed"):
        is_reached(Timestamp(), "0.5dur")


def _due_batches(interval: str, batches: int, samples_per_batch: int = 1,
                 max_duration: str | None = None) -> list[int]:
    due, timestamp = [], Timestamp()
    for _ in range(batches):
        before, timestamp = timestamp, timestamp.to_next_batch(samples_per_batch,
                                                               tokens=10 * samples_per_batch)
        if is_interval_due(before, timestamp, interval, max_duration):
            due.append(timestamp.batch)
    return due


def test_interval_in_batches() -> None:
    assert _due_batches("2ba", 7) == [2, 4, 6]
    assert _due_batches("1ba", 3) == [1, 2, 3]


def test_interval_in_samples_fires_at_first_boundary_at_or_after_each_multiple() -> None:
    assert _due_batches("100sp", 10, samples_per_batch=30) == [4, 7, 10]  # 120, 210, 300
    assert _due_batches("32sp", 4, samples_per_batch=16) == [2, 4]
    assert _due_batches("10sp", 2, samples_per_batch=25) == [1, 2]  # 2 multiples in 1 batch: once


def test_interval_in_tokens() -> None:
    assert _due_batches("1e3tok", 10, samples_per_batch=30) == [4, 7, 10]


def test_interval_in_dur() -> None:
    assert _due_batches("0.25dur", 8, max_duration="8ba") == [2, 4, 6, 8]
    assert _due_batches("0.25dur", 10, max_duration="10ba") == [3, 5, 8, 10]  # every 2.5 batches
    assert _due_batches("0.5dur", 4, samples_per_batch=16, max_duration="64sp") == [2, 4]
    with pytest.raises(ValueError, match="max_duration is needed"):
        is_interval_due(Timestamp(), Timestamp(batch=1), "0.5dur")


def test_interval_in_epochs_fires_around_epoch_ends_only() -> None:
    due, timestamp = [], Timestamp()
    for _ in range(4):
        for _ in range(3):
            before, timestamp = timestamp, timestamp.to_next_batch(8)
            assert not is_interval_due(before, timestamp, "1ep")
        before, timestamp = timestamp, timestamp.to_next_epoch()
        assert not is_interval_due(before, timestamp, "1ba")
        if is_interval_due(before, timestamp, "2ep"):
            due.append(timestamp.epoch)
        assert is_interval_due(before, timestamp, "1ep")
    assert due == [2, 4]
    every_2ep = {"interval": "0.5dur", "max_duration": "4ep"}
    assert not is_interval_due(Timestamp(epoch=0), Timestamp(epoch=1), **every_2ep)
    assert is_interval_due(Timestamp(epoch=1), Timestamp(epoch=2), **every_2ep)


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval must be positive, got '0ba'"):
        is_interval_due(Timestamp(), Timestamp(batch=1), "0ba")


def test_fraction_done() -> None:
    assert fraction_done(Timestamp(), "8ba") == 0.0
    assert fraction_done(Timestamp(batch=2), "8ba") == 0.25
    assert fraction_done(Timestamp(batch=9), "8ba") == 1.0
    assert fraction_done(Timestamp(sample=48), "40sp") == 1.0
    assert fraction_done(Timestamp(epoch=1), "4ep") == 0.25
    assert fraction_done(Timestamp(epoch=1, batch_in_epoch=2), "4ep", batches_per_epoch=4) == 0.375
