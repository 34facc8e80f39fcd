"""The loss curve's picture: the ticks it chooses, and a PNG whose pixels show the curve, its gaps
at NaN and each evaluation's markers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from PIL import Image

from lockstep.callbacks.loss_plot import draw_loss_curve, nice_ticks

BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # the train curve's colour, the first evaluation's


@pytest.mark.parametrize(("low", "high", "whole", "expected"), [
    (0, 100, True, [0, 20, 40, 60, 80, 100]),
    (-0.12, 2.42, False, [0, 0.5, 1, 1.5, 2]),
    (1, 3, True, [1, 2, 3]),
    (2.2, 2.31, False, [2.2, 2.22, 2.24, 2.26, 2.28, 2.3]),
    (5, 5, False, [5]),
])
def test_ticks_are_round_and_inside_the_range(low, high, whole, expected) -> None:
    assert nice_ticks(low, high, whole=whole) == pytest.approx(expected)


def _columns_with(image: Image.Image, color: tuple[int, int, int]) -> set[int]:
    pixels = image.load()
    return {x for x in range(image.width) for y in range(image.height) if pixels[x, y] == color}


def test_the_curve_breaks_at_nan_and_evaluations_are_markers(tmp_path: Path) -> None:
    train = [(float(b), 2.0 - b / 100) for b in range(1, 101)]
    train[49] = (50.0, math.nan)
    draw_loss_curve(tmp_path / "curve.png", "run-1", train, {"eval": [(100.0, 1.0)], "empty": []})
    image = Image.open(tmp_path / "curve.png")
    assert (image.format, image.size) == ("PNG", (700, 400))
    blue = _columns_with(image.crop((0, 0, 540, 400)), BLUE)  # left of the legend's sample line
    # Batches 1..100 span x = 70..680: the line is drawn on both sides of batch 50, not across it.
    assert min(blue) <= 72 and max(blue) >= 535
    nan_at = 70 + (50 - 1) / 99 * 610
    assert not any(abs(x - nan_at) < 3 for x in blue), sorted(blue)
    orange = _columns_with(image.crop((600, 80, 700, 400)), ORANGE)  # the marker at batch 100, below the legend
    assert orange and 75 <= min(orange) and max(orange) <= 85


def test_a_single_batch_and_all_nan_still_draw(tmp_path: Path) -> None:
    draw_loss_curve(tmp_path / "one.png", "r", [(1.0, 0.5)])
    assert _columns_with(Image.open(tmp_path / "one.png").crop((0, 80, 700, 400)), BLUE)
    draw_loss_curve(tmp_path / "nan.png", "r", [(1.0, math.nan), (2.0, math.inf)])
    assert Image.open(tmp_path / "nan.png").size == (700, 400)
