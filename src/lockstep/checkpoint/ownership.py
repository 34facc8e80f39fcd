"""Who writes into a save folder: a run claims the names it will write, for as long as it lives.

Each rank that writes checkpoint files holds a hidden file ``<save_folder>/.lockstep-claim.<run>.rank<r>``
with a POSIX record lock (``fcntl.lockf``) while it trains: the kernel drops the lock when the
process ends, however it ends, so a killed job never blocks its own autoresume, and (unlike
``flock``) a forked child such as a data loader worker does not inherit it. The file records the run
and the glob patterns of its checkpoint names, and is deleted when the claim is given up; a dead
holder's file is deleted by the next claimer. A claim is refused when

- the same run's lock is held by a live process: a second job of the run in the same folder; or
- another live run holds patterns that can name the same files: two runs would overwrite each
  other's checkpoints.

Claims are made one at a time under a short ``flock`` of the folder itself, so two runs starting
together cannot both miss each other.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import glob
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

PREFIX = ".lockstep-claim."
"""The start of a claim file's name."""
_FOLDER_LOCK_WAIT_S = 10.0

_held: dict[Path, list[int]] = {}
"""This process's claims: lock file -> [open descriptor, number of savers holding it]. POSIX locks
belong to the process, and closing any descriptor of the file drops them, so each file is opened
once and kept open while a saver of this process holds it. Claims of this process never refuse
each other: one process trains one run at a time (a notebook that builds a new Trainer before
dropping the old one must not be refused)."""


def claim(folder: Path, run_name: str, rank: int, patterns: list[str]) -> str | None:
    """Claim ``folder`` for this rank of ``run_name``, which writes names matching ``patterns``
    (globs relative to the folder). Returns why it may not (one line), or None once claimed."""
    mine = _path(folder, run_name, rank)
    if mine in _held:
        _held[mine][1] += 1
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _FolderLock(folder):
            return _claim_locked(folder, mine, run_name, rank, patterns)
    except OSError as e:
        return f"cannot claim save_folder {folder} for run {run_name!r}: {e}"


def _claim_locked(folder: Path, mine: Path, run_name: str, rank: int, patterns: list[str]) -> str | None:
    fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        return (f"run {run_name!r} is already running with save_folder {folder} ({who(_read(mine))}): "
                f"stop that job first, or give this one another run_name or save_folder")
    for other in sorted(folder.glob(glob.escape(PREFIX) + "*")):
        if other == mine or other in _held:
            continue
        record = _live_record(other)
        if record is None:
            other.unlink(missing_ok=True)  # its holder is gone
            continue
        if record.get("run_name") == run_name:
            continue
        same = clash(patterns, record.get("patterns", []))
        if same is not None:
            os.close(fd)
            mine.unlink(missing_ok=True)
            return (f"save_folder {folder} is in use by run {record.get('run_name')!r} ({who(record)}), "
                    f"which writes checkpoints named like this run's ({same}): use "
                    f"save_folder='{folder}/{{run_name}}', or put {{run_name}} in save_filename and "
                    f"save_latest_filename")
    record = {"run_name": run_name, "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
              "since": time.time(), "patterns": patterns}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _held[mine] = [fd, 1]
    return None


def release(folder: Path, run_name: str, rank: int) -> None:
    """Give up a claim made by :func:`claim` (once every saver of this process that made it has)."""
    mine = _path(folder, run_name, rank)
    held = _held.get(mine)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _held[mine]
    try:
        with _FolderLock(folder):  # no claimer is reading it meanwhile
            mine.unlink(missing_ok=True)
    except OSError:
        pass  # a file left behind is stale once closed: the next claimer deletes it
    finally:
        os.close(held[0])


def _path(folder: Path, run_name: str, rank: int) -> Path:
    return folder / f"{PREFIX}{safe_name(run_name)}.rank{rank}"


def _live_record(path: Path) -> dict[str, Any] | None:
    """The record of a claim whose holder is alive; None for a stale claim (its holder is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            return _read(path) or {"run_name": "(unknown)"}
        return None  # we got it: nobody holds it
    finally:
        os.close(fd)  # drops the probe's lock, if taken


def clash(mine: list[str], theirs: list[str]) -> str | None:
    """A pair of patterns that can name the same file, shown as one."""
    for a in mine:
        for b in theirs:
            if a == b or fnmatch.fnmatchcase(a, b) or fnmatch.fnmatchcase(b, a):
                return a
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def who(record: dict[str, Any]) -> str:
    """Who holds a claim, for a message: its pid and host."""
    if "pid" not in record:
        return "a live process"
    return f"pid {record['pid']} on {record.get('host', '?')}"


def safe_name(run_name: str) -> str:
    """``run_name`` as a file name: characters other than letters, digits, ``-_.`` become ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_name)


class _FolderLock:
    """An exclusive ``flock`` of the folder itself around one claim: held for milliseconds, so
    waiting is short; where the file system has no such locks, claims go without it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fd = -1

    def __enter__(self) -> _FolderLock:
        self.fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        deadline = time.monotonic() + _FOLDER_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() > deadline:
                    return self  # no folder locks here (ENOLCK, EOPNOTSUPP), or a holder that hangs
                time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # drops the flock
