"""Preemption: on SIGTERM every rank stops at the same step, saves, and exits.

Ranks get the signal at slightly different moments, so each one only records it. At every step a
one-element all-reduce of the flags is started without waiting; the next step reads its result.
All ranks read the same sum at the same step, so they agree on where to stop, and no step waits on
the network for it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as torch_dist

from lockstep import dist

EXIT_CODE = 128 + signal.SIGTERM


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

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        if dist.get_world_size() > 1 and dist.is_initialized():
            # the flag is a CPU tensor: on NCCL it needs a gloo group of its own
            if torch_dist.get_backend() != "gloo":
                self._group = torch_dist.new_group(backend="gloo")
            self._tensor = torch.zeros(1, dtype=torch.int32)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._flag = True

    def agreed(self) -> bool:
        """True on every rank at the same step, one or two steps after any rank got SIGTERM."""
        if self._tensor is None:
            return self._flag
        stop = False
        if self._pending is not None:
            self._pending.wait()
            stop = int(self._tensor.item()) > 0
        self._tensor.fill_(int(self._flag))
        self._pending = torch_dist.all_reduce(self._tensor, group=self._group, async_op=True)
        return stop

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._pending is not None and exc_type is None:
            self._pending.wait()  # every rank started it, so every rank can finish it
        self._pending = None
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
