"""Progress reports from a rank to its launcher, through a small shared-memory slot per rank.

The launcher creates one 32-byte file per local rank in a node-local folder (``LOCKSTEP_CONTROL_DIR``)
and watches it for stalls (``--stall_timeout``). A rank maps its file and, at each report, overwrites
it: no system call, no lock, no collective, a microsecond or so. Under torchrun, or in a process not
started by ``lockstep``, every call here is a no-op.

Layout, little-endian: beats (u64), last completed step (i64), time of the last beat
(``time.monotonic()``, f64, comparable across processes of one machine), phase (u64).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

CONTROL_DIR_ENV = "LOCKSTEP_CONTROL_DIR"
SLOT = struct.Struct("<QqdQ")


class Phase(IntEnum):
    IDLE = 0
    """Not reporting (before the first beat, after training): the stall clock does not run."""
    RUNNING = 1
    """Beating: no beat for --stall_timeout seconds is a stall."""
    PAUSED = 2
    """A long step that cannot beat (a checkpoint write): no rank is called stalled meanwhile."""


def slot_path(control_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(control_dir) / f"rank{rank}.progress"


def echo_path(control_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(control_dir) / f"rank{rank}.echo"


def ended_path(control_dir: str | os.PathLike[str], rank: int) -> Path:
    """When the rank's script ended with an error (its ``time.time()``), written by the worker
    bootstrap before the rank's teardown closes its connections to the others."""
    return Path(control_dir) / f"rank{rank}.ended"


def echo(origin: int) -> None:
    """This rank is about to fail with rank ``origin``'s error, which every rank raises once they
    agreed on it: the launcher then names ``origin`` as the rank that failed first, even when this
    rank exits before it. A no-op outside ``lockstep``."""
    folder, rank = os.environ.get(CONTROL_DIR_ENV), os.environ.get("RANK")
    if folder and rank is not None and str(origin) != rank:
        try:
            echo_path(folder, int(rank)).write_text(str(origin))
        except (OSError, ValueError):
            pass  # a launcher that is gone: it blames nobody


@dataclass(frozen=True)
class Progress:
    """One reading of a rank's slot."""

    beats: int
    step: int
    time: float
    phase: Phase

    @classmethod
    def read(cls, buffer: bytes) -> Progress:
        beats, step, when, phase = SLOT.unpack_from(buffer)
        return cls(beats, step, when, Phase(phase) if phase in Phase._value2member_map_ else Phase.IDLE)


class _Slot:
    """The rank's side: its mapped slot."""

    def __init__(self, path: Path) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SLOT.size)
        self.beats = 0
        self.step = 0
        self.phase = Phase.IDLE

    def write(self, step: int | None, phase: Phase) -> None:
        self.beats += 1
        self.step = self.beats if step is None else step
        self.phase = phase
        SLOT.pack_into(self._map, 0, self.beats, self.step, time.monotonic(), phase)


_slot: _Slot | None = None
_opened = False


def _open() -> _Slot | None:
    global _slot, _opened
    _opened = True
    folder = os.environ.get(CONTROL_DIR_ENV)
    rank = os.environ.get("RANK")
    if folder and rank is not None:
        try:
            _slot = _Slot(slot_path(folder, int(rank)))
        except (OSError, ValueError):
            _slot = None  # a stale variable, or a launcher that is gone: report nothing
    return _slot


def heartbeat(step: int | None = None) -> None:
    """Tell the launcher this rank made progress (finished ``step``; default: count the calls).

    Only ranks that have called this are watched by ``--stall_timeout``, from their first call on.
    Costs about a microsecond and never blocks; a no-op outside ``lockstep``.
    """
    slot = _slot if _opened else _open()
    if slot is not None:
        slot.write(step, Phase.RUNNING)


def stop_heartbeat() -> None:
    """Stop being watched for stalls (training is over; what follows may wait for other ranks)."""
    slot = _slot if _opened else _open()
    if slot is not None and slot.phase is not Phase.IDLE:
        slot.write(slot.step, Phase.IDLE)


def watched() -> bool:
    """Whether a launcher is watching this rank for stalls right now (it has beaten, not stopped)."""
    slot = _slot if _opened else _open()
    return slot is not None and slot.phase is not Phase.IDLE


@contextlib.contextmanager
def heartbeat_paused() -> Iterator[None]:
    """Within this block no rank of the job is called stalled: for a long step that cannot beat,
    such as a checkpoint write, while the other ranks wait for it in a collective. It beats on exit.
    """
    slot = _slot if _opened else _open()
    if slot is None or slot.phase is Phase.PAUSED:
        yield
        return
    before = slot.phase
    slot.write(slot.step, Phase.PAUSED)
    try:
        yield
    finally:
        slot.write(slot.step, before)
