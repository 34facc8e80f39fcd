"""Which of a run's checkpoints a bucket keeps (``save_num_checkpoints_to_keep``).

The bucket is rotated on a record of its own, not on the staging folder's save history: uploads
lag behind the local saves, and the local rotation drops a checkpoint from that history once
``keep`` newer ones are on the disk, which may be before the bucket holds a newer one complete.
A rotation that followed the local history would never delete such a checkpoint from the bucket.

The record lists the run's checkpoints in the order of their latest save, and knows which are
complete in the bucket. Once a save is complete there, every checkpoint saved before it goes but
the newest ``keep - 1`` complete ones: older complete ones, and older saves that never became
complete (dropped from a rank's upload queue, so perhaps half uploaded by the other ranks). A
restarted job starts its record with what earlier attempts left in the bucket under the run's
names (:func:`left_earlier`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lockstep.checkpoint import templates

_ORDER = ("batch", "sample", "token", "epoch")
"""The time fields that order a run's checkpoint names, first the finest."""


class BucketRotation:
    """One rank's record of the checkpoints it writes into a bucket, and what rotation deletes."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        """How many checkpoints the bucket keeps (-1: every one)."""
        self._order: list[str] = []
        """Names, oldest first, each where its latest save puts it."""
        self._complete: set[str] = set()

    def earlier(self, stale: Iterable[str], kept: Iterable[str]) -> None:
        """Start with what earlier attempts left: ``kept``, complete checkpoints oldest first, and
        ``stale`` ones, which go at the first rotation."""
        kept = list(kept)
        self._order = [n for n in stale if n not in kept] + kept + [n for n in self._order if n not in kept]
        self._complete.update(kept)

    def saved(self, name: str) -> None:
        """``name`` was saved now (and handed to the uploads): it is the newest."""
        if name in self._order:
            self._order.remove(name)
        self._order.append(name)

    def settle(self, saves: Sequence[tuple[str, bool]]) -> list[str]:
        """``saves``: the saves up to the newest one that is complete in the bucket, in save order,
        each with whether it is complete (the last one is). Returns what to delete from the bucket."""
        for name, complete in saves:
            if complete:
                self._complete.add(name)
            else:
                self._complete.discard(name)
        newest = saves[-1][0]
        if self.keep < 1 or newest not in self._order:
            return []
        at = self._order.index(newest)
        older = self._order[:at]
        complete = [n for n in older if n in self._complete]
        kept = complete[max(0, len(complete) - (self.keep - 1)):]
        removed = [n for n in older if n not in kept]
        self._order = kept + self._order[at:]
        self._complete.difference_update(removed)
        return removed


def left_earlier(names: Iterable[str], template: str, place: dict[str, Any],
                 resumed: str | None) -> tuple[list[str], list[str]]:
    """Of the names in a bucket's folder, the run's checkpoints (names ``template`` makes with
    ``place``) that earlier attempts left: ``(stale, kept)``. Kept, oldest first: those not newer
    than the checkpoint the run resumed from (``resumed``; by their names' time fields). Stale:
    those newer, which this attempt saves again or which belong to a past that it does not
    continue, and all of them when the run starts fresh (``resumed`` None)."""
    timed = {n: key for n in names if (key := _time_key(templates.time_fields(template, place, n))) is not None}
    ordered = sorted(timed, key=lambda n: timed[n])
    if resumed is None:
        return ordered, []
    at = _time_key(templates.time_fields(template, place, resumed))
    if at is None:  # a name that tells no time: nothing is known newer
        return [], ordered
    return [n for n in ordered if timed[n] > at], [n for n in ordered if timed[n] <= at]


def _time_key(fields: dict[str, int] | None) -> tuple[int, ...] | None:
    """A sort key of a name's time fields; the names of one template have the same fields."""
    if fields is None:
        return None
    return tuple(fields[unit] for unit in _ORDER if unit in fields)
