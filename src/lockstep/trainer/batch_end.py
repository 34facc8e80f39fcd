"""The end of a batch after BATCH_END, as steps taken in turn: an elastic job whose ranks change
during one of them takes that step up again on the new process group, with those after it, and
never one already taken (an epoch counted twice, an evaluation logged twice)."""

from __future__ import annotations

from collections.abc import Callable


class BatchEnd:
    """The steps of one batch's end, and how many of them were taken."""

    def __init__(self, steps: list[Callable[[], object]], ends_epoch: bool) -> None:
        self.steps, self.taken, self.ends_epoch = steps, 0, ends_epoch

    def run(self) -> None:
        """Take the steps not taken yet, in turn."""
        while self.taken < len(self.steps):
            self.steps[self.taken]()
            self.taken += 1
