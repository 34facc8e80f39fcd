"""The end of a batch after BATCH_END, as steps taken in turn: an elastic job whose ranks change
during one of them takes that step up again on the new process group, with those after it, and
never one already taken (an epoch counted twice, an evaluation logged twice)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lockstep.time import Timestamp


class BatchEnd:
    """The steps of one batch's end, and how many of them were taken; the timestamps before and
    after the batch they were made from, for a rank that joins a running job while the others are
    in it (:meth:`described`)."""

    def __init__(self, steps: list[Callable[[], object]], ends_epoch: bool, before: Timestamp,
                 after: Timestamp) -> None:
        self.steps, self.taken, self.ends_epoch = steps, 0, ends_epoch
        self.before, self.after = before, after

    def described(self) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """What another rank makes the same steps from: the timestamps (state dicts) and whether the
        batch ends an epoch."""
        return self.before.state_dict(), self.after.state_dict(), self.ends_epoch

    def run(self) -> None:
        """Take the steps not taken yet, in turn."""
        while self.taken < len(self.steps):
            self.steps[self.taken]()
            self.taken += 1
