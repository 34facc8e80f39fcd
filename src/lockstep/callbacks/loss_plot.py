"""The picture of the loss curve (``loss_curve.png``), drawn with Pillow.

Pillow draws it in ~0.05 s of CPU, where importing matplotlib alone took ~0.75 s at every fit's
end on rank 0 (most of what a short run spends after training).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["draw_loss_curve", "nice_ticks"]

Point = tuple[float, float]
_SIZE = (700, 400)
_LEFT, _TOP, _RIGHT, _BOTTOM = 70, 34, 20, 46  # the margins around the plotting area, in pixels
_COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75))
_GRID, _INK, _MUTED = (225, 225, 225), (0, 0, 0), (90, 90, 90)


def nice_ticks(low: float, high: float, count: int = 6, *, whole: bool = False) -> list[float]:
    """About ``count`` round values (the step of 1, 2, 2.5 or 5 times a power of ten nearest to an
    even split; with ``whole``, whole numbers only) from ``low`` to ``high``, both included when
    they are round."""
    if high <= low:
        return [low]
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10)), key=lambda step: abs(math.log(step / raw)))
    if whole:
        step = max(1.0, 2.0 if step == 2.5 else step)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    for i in range(count * 3):
        value = first + i * step
        if value > high + step * 1e-9:
            break
        ticks.append(0.0 if abs(value) < step * 1e-9 else round(value, 12))
    return ticks


def _label(value: float) -> str:
    return f"{value:.6g}"


def _runs(points: Sequence[Point]) -> list[list[Point]]:
    """``points`` split where a value is not finite: a line never crosses a NaN or an infinity."""
    runs: list[list[Point]] = [[]]
    for x, y in points:
        if math.isfinite(y):
            runs[-1].append((x, y))
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


class _Axes:
    """Data coordinates to pixels, over the finite values of every series."""

    def __init__(self, series: Sequence[Sequence[Point]]) -> None:
        xs = [x for points in series for x, _ in points]
        ys = [y for points in series for _, y in points if math.isfinite(y)] or [0.0]
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if self.x1 == self.x0:
            self.x0, self.x1 = self.x0 - 1, self.x1 + 1
        low, high = min(ys), max(ys)
        pad = (high - low) * 0.05 or max(abs(high) * 0.05, 1e-3)
        self.y0, self.y1 = low - pad, high + pad
        self.width = _SIZE[0] - _LEFT - _RIGHT
        self.height = _SIZE[1] - _TOP - _BOTTOM

    def at(self, x: float, y: float) -> tuple[float, float]:
        return (_LEFT + (x - self.x0) / (self.x1 - self.x0) * self.width,
                _TOP + (1 - (y - self.y0) / (self.y1 - self.y0)) * self.height)


def draw_loss_curve(path: str | Path, title: str, train: Sequence[Point],
                    evaluations: Mapping[str, Sequence[Point]] | None = None) -> None:
    """Write to ``path`` a PNG of the training loss per batch (a line) and each evaluation's loss
    (markers with their values: a few measured points, no line implying a trend between them)."""
    from PIL import Image, ImageDraw, ImageFont

    evaluations = {label: points for label, points in (evaluations or {}).items() if points}
    axes = _Axes([train, *evaluations.values()])
    image = Image.new("RGB", _SIZE, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=12)
    _frame(draw, font, axes)
    for run in _runs(train):
        if len(run) == 1:  # a lone value between NaNs, or a run of one batch: a dot
            px, py = axes.at(*run[0])
            draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=_COLORS[0])
        else:
            draw.line([axes.at(x, y) for x, y in run], fill=_COLORS[0], width=1)
    for color, points in zip(_COLORS[1:] * 8, evaluations.values()):
        for x, y in points:
            if math.isfinite(y):
                px, py = axes.at(x, y)
                draw.ellipse((px - 4, py - 4, px + 4, py + 4), fill=color)
                near_right = px > _LEFT + axes.width * 0.85  # its value goes to the left of it there
                draw.text((px - 5 if near_right else px + 5, py - 6), f"{y:.3g}", fill=_INK, font=font,
                          anchor="rb" if near_right else "lb")
    entries = [("train loss", _COLORS[0], True)]
    entries += [(f"{label} loss", color, False) for color, label in zip(_COLORS[1:] * 8, evaluations)]
    _legend(draw, font, entries)
    draw.text((_SIZE[0] / 2, _TOP / 2), title, fill=_INK, font=ImageFont.load_default(size=14), anchor="mm")
    _vertical_text(image, font, "loss", (14, _TOP + axes.height / 2))
    image.save(path, format="PNG")


def _frame(draw: Any, font: Any, axes: _Axes) -> None:
    """The grid, the box, the ticks with their values, and the x axis's name."""
    for x in nice_ticks(axes.x0, axes.x1, whole=True):
        px = axes.at(x, axes.y0)[0]
        draw.line([(px, _TOP), (px, _TOP + axes.height)], fill=_GRID)
        draw.line([(px, _TOP + axes.height), (px, _TOP + axes.height + 4)], fill=_INK)
        draw.text((px, _TOP + axes.height + 7), _label(x), fill=_MUTED, font=font, anchor="mt")
    for y in nice_ticks(axes.y0, axes.y1):
        py = axes.at(axes.x0, y)[1]
        draw.line([(_LEFT, py), (_LEFT + axes.width, py)], fill=_GRID)
        draw.line([(_LEFT - 4, py), (_LEFT, py)], fill=_INK)
        draw.text((_LEFT - 7, py), _label(y), fill=_MUTED, font=font, anchor="rm")
    draw.rectangle((_LEFT, _TOP, _LEFT + axes.width, _TOP + axes.height), outline=_INK)
    draw.text((_LEFT + axes.width / 2, _SIZE[1] - 8), "batch", fill=_INK, font=font, anchor="md")


def _legend(draw: Any, font: Any, entries: list[tuple[str, tuple[int, int, int], bool]]) -> None:
    """A box in the upper right corner naming each series: a line for a curve, a dot for markers."""
    width = max(draw.textlength(label, font=font) for label, _, _ in entries) + 42
    right, top = _SIZE[0] - _RIGHT - 8, _TOP + 8
    draw.rectangle((right - width, top, right, top + 8 + 18 * len(entries)), fill="white", outline=_GRID)
    for i, (label, color, line) in enumerate(entries):
        y = top + 13 + 18 * i
        if line:
            draw.line([(right - width + 8, y), (right - width + 30, y)], fill=color, width=2)
        else:
            draw.ellipse((right - width + 15, y - 4, right - width + 23, y + 4), fill=color)
        draw.text((right - width + 36, y), label, fill=_INK, font=font, anchor="lm")


def _vertical_text(image: Any, font: Any, text: str, center: tuple[float, float]) -> None:
    from PIL import Image, ImageDraw

    box = ImageDraw.Draw(image).textbbox((0, 0), text, font=font)
    label = Image.new("RGB", (box[2] + 2, box[3] + 2), "white")
    ImageDraw.Draw(label).text((1, 1), text, fill=_INK, font=font)
    turned = label.rotate(90, expand=True)
    image.paste(turned, (int(center[0] - turned.width / 2), int(center[1] - turned.height / 2)))
