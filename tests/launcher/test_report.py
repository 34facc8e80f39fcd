"""What the launcher shows of a failed rank's output: a traceback whole, not its last 30 lines."""

from __future__ import annotations

from lockstep.launcher.report import TAIL_LINES, shown_part


def _traceback(frames: int, error: str) -> list[str]:
    lines = ["Traceback (most recent call last):\n"]
    for i in range(frames):
        lines += [f'  File "train.py", line {i}, in f{i}\n', f"    f{i + 1}()\n"]
    return lines + [f"{error}\n"]


def test_a_deep_traceback_is_shown_from_its_first_line() -> None:
    output = [f"step {i}\n" for i in range(50)] + _traceback(20, "ValueError: bad")
    shown = shown_part(output)
    assert len(shown) == 42 > TAIL_LINES
    assert shown[0].startswith("Traceback") and shown[-1] == "ValueError: bad\n"


def test_a_chained_traceback_is_shown_with_the_one_it_came_from() -> None:
    first, second = _traceback(2, "KeyError: 'x'"), _traceback(3, "ValueError: bad")
    output = ["log\n", *first, "\n", "During handling of the above exception, another exception occurred:\n", "\n",
              *second]
    assert shown_part(output) == output[1:]


def test_a_traceback_that_torch_prefixed_with_the_rank_is_shown_from_its_first_line() -> None:
    # torch's excepthook puts "[rankN]: " in front of each line of a rank's traceback
    output = [f"step {i}\n" for i in range(50)] + [f"[rank3]: {line}" for line in _traceback(20, "ValueError: bad")]
    shown = shown_part(output)
    assert shown[0] == "[rank3]: Traceback (most recent call last):\n" and len(shown) == 42


def test_output_without_a_traceback_is_its_last_lines() -> None:
    output = [f"line {i}\n" for i in range(100)]
    assert shown_part(output) == output[-TAIL_LINES:]
