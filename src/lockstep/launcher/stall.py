"""Stall detection (``--stall_timeout``): read each rank's progress slot, and explain a stall.

A rank is watched from its first heartbeat until it stops reporting (the end of ``fit``). The job
has stalled when a watched rank made no progress for the timeout while no rank of this node was in
a paused step (a checkpoint write). The diagnosis then sorts the ranks by their stacks: a rank
whose main thread is not in a collective stopped on its own; the ones in a collective wait for it.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from pathlib import Path

from lockstep.launcher.job import STOPPED, WAITING, Failure
from lockstep.launcher.stacks import Stacks
from lockstep.progress import SLOT, Phase, Progress, echo_path, ended_path, slot_path

STALL_EXIT_CODE = 124
"""The launcher's exit code after a stall (as timeout(1)'s): distinct from any rank's failure."""
_STACK_LINES = 30  # of a stalled rank's main thread, shown on every node


class ProgressBoard:
    """The launcher's view of this node's progress slots."""

    def __init__(self, control_dir: Path, ranks: list[int]) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._control_dir = control_dir
        for rank in ranks:
            self._forget(rank)  # an earlier attempt's
            path = slot_path(control_dir, rank)
            path.write_bytes(bytes(SLOT.size))  # a fresh slot for every attempt
            with open(path, "rb") as f:
                self._maps[rank] = mmap.mmap(f.fileno(), SLOT.size, access=mmap.ACCESS_READ)

    def reset(self, rank: int) -> None:
        """A fresh slot for ``rank``, started again in place: nothing its earlier process recorded."""
        self._forget(rank)
        with open(slot_path(self._control_dir, rank), "r+b") as f:
            f.write(bytes(SLOT.size))

    def _forget(self, rank: int) -> None:
        """Remove the records of ``rank``'s script ending with an error (its own, or a peer's echoed)."""
        echo_path(self._control_dir, rank).unlink(missing_ok=True)
        ended_path(self._control_dir, rank).unlink(missing_ok=True)

    def echo_of(self, rank: int) -> int | None:
        """The rank whose error ``rank`` raised as its own (see :func:`lockstep.progress.echo`), if any."""
        try:
            return int(echo_path(self._control_dir, rank).read_text())
        except (OSError, ValueError):
            return None

    def ended_before(self, rank: int, others: list[int]) -> int | None:
        """Of ``others``, the one whose script ended with an error first, before ``rank``'s did
        (each rank's record of it: :func:`lockstep.progress.ended_path`); None if none did. A rank
        whose peer's teardown broke its collective may exit before that peer has."""
        when = {r: self.ended_at(r) for r in (rank, *others)}
        mine = when.pop(rank)
        earlier = [(t, r) for r, t in when.items() if t is not None and mine is not None and t < mine]
        return min(earlier)[1] if earlier else None

    def ended_order(self, rank: int) -> float:
        """A sort key: when the rank's script ended with an error, those that did not record one last."""
        ended = self.ended_at(rank)
        return float("inf") if ended is None else ended

    def ended_at(self, rank: int) -> float | None:
        """When the rank's script ended with an error (``time.time()``), if it recorded that."""
        try:
            return float(ended_path(self._control_dir, rank).read_text())
        except (OSError, ValueError):
            return None

    def read(self) -> dict[int, Progress]:
        return {rank: Progress.read(m) for rank, m in self._maps.items()}

    def stalled(self, live: set[int], now: float, timeout: float) -> list[int]:
        """Live watched ranks without progress for ``timeout`` seconds; none while any is paused."""
        progress = {r: p for r, p in self.read().items() if r in live}
        if any(p.phase is Phase.PAUSED for p in progress.values()):
            return []
        return [r for r, p in progress.items() if p.phase is Phase.RUNNING and now - p.time >= timeout]

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


@dataclass(frozen=True)
class Diagnosis:
    stopped: list[int]
    """Ranks that stopped on their own: the place to look."""
    waiting: list[int]
    """Ranks waiting for them in a collective."""
    lines: list[str]


def diagnose(dumps: list[Stacks], progress: dict[int, Progress], now: float) -> Diagnosis:
    """Name the ranks that stopped first and those waiting for them, with each one's last step."""
    known = [d for d in dumps if d.text]
    waiting = [d.rank for d in known if d.in_collective]
    stopped = [d.rank for d in known if not d.in_collective]
    why = "its main thread is not in a collective"
    if not stopped and waiting:
        # Every rank is in a collective: the ones behind (fewest steps) are in a different one.
        steps = {r: progress[r].step for r in waiting if r in progress}
        behind = min(steps.values(), default=None)
        if behind is not None and any(s != behind for s in steps.values()):
            stopped = [r for r in waiting if steps.get(r) == behind]
            waiting = [r for r in waiting if r not in stopped]
            why = "it is in a collective that the others, further on, are not in"
    lines = []
    for d in dumps:
        p = progress.get(d.rank)
        step = f"last completed step {p.step}, {now - p.time:.0f} s ago" if p and p.beats else "never reported"
        role = ("stopped first" if d.rank in stopped else "waiting in a collective" if d.rank in waiting
                else f"no stack ({d.why_missing})")
        where = f"; at {d.innermost}" if d.text else ""
        lines.append(f"rank {d.rank} (pid {d.pid}): {role}; {step}{where}")
    if stopped:
        lines.append(f"look at rank{'s' if len(stopped) > 1 else ''} {_join(stopped)} first: {why}")
    elif waiting:
        lines.append("every rank is waiting in the same collective: one may be stuck inside the "
                     "transport, or a rank on another node stopped")
    return Diagnosis(stopped, waiting, lines)


def stall_failures(diagnosis: Diagnosis, dumps: list[Stacks], progress: dict[int, Progress], node: int,
                   host: str, suspects: list[int]) -> list[Failure]:
    """What this node records of a stall for the other nodes: each rank it found stopped, dated by
    its last progress; else one rank of ``suspects`` (or any) as waiting, a lower-ranked cause."""
    by_rank = {d.rank: d for d in dumps}
    now, wall = time.monotonic(), time.time()
    failures = []
    for rank in diagnosis.stopped:
        p = progress.get(rank)
        when = wall - (now - p.time) if p is not None and p.beats else wall
        failures.append(_stall_failure(by_rank[rank], node, host, when, STOPPED))
    if failures:
        return failures
    rank = [*diagnosis.waiting, *suspects, *by_rank, -1][0]
    return [_stall_failure(by_rank.get(rank, Stacks(rank, 0, "")), node, host, wall, WAITING)]


def _stall_failure(dump: Stacks, node: int, host: str, when: float, cause: str) -> Failure:
    tail = dump.main_thread.splitlines()[:_STACK_LINES] if dump.text else []
    return Failure(node, host, dump.rank, STALL_EXIT_CODE, when, tail, dump.pid, cause)


def _join(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
