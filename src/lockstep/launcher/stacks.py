"""Every local rank's Python stacks, on demand: the launcher signals each rank and reads its file.

The worker bootstrap registers ``faulthandler`` on SIGQUIT with a file in the control folder
(``rank{R}.stacks``) and writes a first line naming its main thread. The launcher signals only a
rank whose file has that line (before it, SIGQUIT would still end the process), then reads what the
handler appended.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_SETTLE_S = 0.1  # a dump is complete once its file stopped growing for this long
_MAIN = re.compile(r"main thread (0x[0-9a-f]+)")
# Frames in these files mean the thread waits for other ranks (a collective, DDP's gradient
# all-reduce at the end of backward, an FSDP all-gather).
_COLLECTIVE_PATHS = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py",
                     "deepspeed/comm/", "lockstep/dist.py", "lockstep/_agreement.py")


def stacks_path(control_dir: Path, rank: int) -> Path:
    return control_dir / f"rank{rank}.stacks"


@dataclass
class Stacks:
    """What one rank's dump said."""

    rank: int
    pid: int
    text: str
    """faulthandler's dump of every thread; empty when the rank could not be asked."""
    why_missing: str = ""
    main_ident: str | None = None
    """The main thread's id as faulthandler writes it (0x and 16 hex digits)."""

    @property
    def main_thread(self) -> str:
        """The dump of the main thread alone (the whole dump when it cannot be told apart)."""
        for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", self.text):
            if self.main_ident and self.main_ident in block.split("\n", 1)[0]:
                return block
        return self.text

    @property
    def in_collective(self) -> bool:
        """The main thread is waiting for other ranks."""
        frames = [line for line in self.main_thread.splitlines() if line.lstrip().startswith("File ")]
        return any(p in line.replace("\\", "/") for line in frames for p in _COLLECTIVE_PATHS)

    @property
    def innermost(self) -> str:
        """The main thread's innermost frame, as faulthandler wrote it."""
        for line in self.main_thread.splitlines():
            if line.lstrip().startswith("File "):
                return line.strip()
        return "(no Python frame)"


def _main_ident(header: bytes) -> str | None:
    match = _MAIN.search(header.decode(errors="replace"))
    return f"0x{int(match.group(1), 16):016x}" if match else None


def collect(control_dir: Path, ranks: list[tuple[int, int]], timeout: float = 3.0) -> list[Stacks]:
    """Dump the stacks of ``ranks`` ((global rank, pid) of live ranks), all at once."""
    paths = {rank: stacks_path(control_dir, rank) for rank, _ in ranks}
    header = {rank: _read(path) for rank, path in paths.items()}  # bytes: offsets are byte counts
    asked = []
    result: dict[int, Stacks] = {}
    for rank, pid in ranks:
        if _main_ident(header[rank]) is None:
            result[rank] = Stacks(rank, pid, "", "it is not a Python rank started by lockstep, or not yet")
            continue
        try:
            os.kill(pid, signal.SIGQUIT)
            asked.append((rank, pid))
        except ProcessLookupError:
            result[rank] = Stacks(rank, pid, "", "it has exited")
    sizes = {rank: len(header[rank]) for rank, _ in asked}
    last_change = {rank: None for rank, _ in asked}
    deadline = time.monotonic() + timeout
    while asked and time.monotonic() < deadline:
        time.sleep(0.02)
        now = time.monotonic()
        for rank, _ in asked:
            size = _size(paths[rank])
            if size != sizes[rank]:
                sizes[rank], last_change[rank] = size, now
        if all(t is not None and now - t >= _SETTLE_S for t in last_change.values()):
            break
    for rank, pid in asked:
        text = _read(paths[rank])[len(header[rank]):].decode(errors="replace")
        result[rank] = Stacks(rank, pid, text.strip("\n"), "" if text.strip() else "it did not answer in time",
                              _main_ident(header[rank]))
    return [result[rank] for rank, _ in ranks]


def format_stacks(dumps: list[Stacks]) -> str:
    """Each rank's dump under a ``rank N (pid P)`` heading, for the console."""
    parts = []
    for d in dumps:
        body = d.text if d.text else f"  (no stack: {d.why_missing})"
        parts.append(f"rank {d.rank} (pid {d.pid})\n{_indent(body)}")
    return "\n".join(parts) + "\n"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
