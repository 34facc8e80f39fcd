"""Preemption: on SIGTERM every rank stops at the same step, saves, and exits.

Ranks get the signal at slightly different moments, so each one only records it. Every few steps
a small all-reduce of the flags is started without waiting; the next check reads its result. All
ranks read the same result at the same step, so they agree on where to stop, and no step waits on
the network for it.

How many steps apart the checks are is agreed in the same all-reduce: each rank proposes as many
steps as take about :data:`CHECK_SECONDS`, and all take the smallest proposal. So a check costs
well under a percent of a step, however short the steps, and a SIGTERM stops the run within
about two check intervals plus a step (well inside the launcher's grace period).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as torch_dist

from lockstep import _agreement, dist

EXIT_CODE = 128 + signal.SIGTERM
CHECK_SECONDS = 0.25
"""About how long apart two checks for a stop are."""
MAX_CHECK_STEPS = 1000


class Preempted(SystemExit):
    """Raised by ``Trainer.fit`` after the preemption checkpoint is written; exits with 143."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignal:
    """Context manager that turns SIGTERM into an agreed stop step (see the module docstring)."""

    def __init__(self) -> None:
        self._flag = False
        self._previous: Any = None
        self._installed = False
        self._pending: Any = None
        self._tensor: torch.Tensor | None = None
        self._group: Any = None
        self._every = 1  # steps between checks: the same on every rank, agreed at each check
        self._countdown = 1
        self._checked_at = 0.0

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        self._agree_over_the_group()
        return self

    def _agree_over_the_group(self) -> None:
        """Check at the next step, over the default process group as it is now."""
        self._tensor, self._group, self._pending = None, None, None
        if dist.get_world_size() > 1 and dist.is_initialized():
            self._group = _agreement.host_group()  # the flag is a CPU tensor: NCCL cannot reduce it
            self._tensor = torch.zeros(2, dtype=torch.int64)  # [any rank stopping, -(next interval)]
        self._every, self._countdown = 1, 1
        self._checked_at = time.perf_counter()

    def regroup(self) -> None:
        """After an elastic job's ranks changed (on every rank of the new process group): check at
        the next step, over the new group, as at the start. A rank that joined has none of the
        others' schedule of checks, and a check in flight on the old group is dropped (this
        rank's flag goes into the next one)."""
        self._agree_over_the_group()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._flag = True

    def agreed(self) -> bool:
        """Call once per step on every rank: True on every rank at the same step, within about
        two check intervals after any rank got SIGTERM."""
        if self._tensor is None:
            return self._flag
        self._countdown -= 1
        if self._countdown > 0:
            return False
        stop, every = False, self._every
        if self._pending is not None:
            self._pending.wait()
            stop, self._every = bool(self._tensor[0] > 0), int(-self._tensor[1])
        now = time.perf_counter()
        step_seconds = (now - self._checked_at) / every
        self._checked_at = now
        propose = min(MAX_CHECK_STEPS, max(1, int(CHECK_SECONDS / max(step_seconds, 1e-9))))
        self._tensor[0], self._tensor[1] = int(self._flag), -propose  # MAX takes the smallest proposal
        self._pending = torch_dist.all_reduce(self._tensor, op=torch_dist.ReduceOp.MAX, group=self._group,
                                              async_op=True)
        self._countdown = self._every
        return stop

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._pending is not None and exc_type is None:
            self._pending.wait()  # every rank started it, so every rank can finish it
        self._pending = None
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
