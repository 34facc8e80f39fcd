"""Where a rank's output goes: the console, its log files, or both (``--tee``).

A stream that is not teed is handed to the rank as a file descriptor (the console's or a log
file's), so the launcher never copies it. A teed stream goes through a pipe that the supervisor
drains with :class:`LinePump`, which appends the bytes to the rank's log file as they come and
writes each complete line to the launcher's console behind a ``[rank N]`` prefix.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from lockstep.launcher.plan import LaunchError, LaunchPlan, RankSpec, Stream

_READ_SIZE = 64 * 1024
_MAX_LINE = 64 * 1024  # a longer line without a newline (a progress bar) is shown in pieces


@dataclass
class RankLogs:
    """The open log files of one rank; None for a stream that goes to the console only."""

    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def close(self) -> None:
        for f in {id(f): f for f in (self.stdout, self.stderr) if f is not None}.values():
            f.close()


def prepare_run_directory(plan: LaunchPlan) -> None:
    """Create the run directory and remove error files an earlier attempt left there."""
    try:
        plan.run_directory.mkdir(parents=True, exist_ok=True)
        for spec in plan.ranks:
            spec.error_file.unlink(missing_ok=True)
    except OSError as e:
        raise LaunchError(f"--run_directory {str(plan.run_directory)!r} cannot be used "
                          f"({e.strerror}): pass a folder you can write to") from None


def open_logs(spec: RankSpec) -> RankLogs:
    """Open (append) the rank's log files; LaunchError naming the flag when one cannot be."""
    files: dict[Path, IO[bytes]] = {}
    opened = []
    for flag, path in (("--stdout", spec.stdout_path), ("--stderr", spec.stderr_path)):
        if path is None:
            opened.append(None)
            continue
        if path not in files:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                files[path] = open(path, "ab")
            except OSError as e:
                for f in files.values():
                    f.close()
                raise LaunchError(f"{flag}: cannot write rank {spec.rank}'s log {str(path)!r} "
                                  f"({e.strerror}): pass a writable path") from None
        opened.append(files[path])
    return RankLogs(*opened)


def console_streams(spec: RankSpec) -> Stream:
    """The streams of this rank that appear on the launcher's console."""
    shown = spec.tee
    if spec.stdout_path is None:
        shown |= Stream.STDOUT
    if spec.stderr_path is None:
        shown |= Stream.STDERR
    return shown


class LinePump:
    """Copies one rank's piped stream to its log file and, line by line, to the console."""

    def __init__(self, source: IO[bytes], log: IO[bytes], console: BinaryIO, prefix: bytes) -> None:
        self._source = source
        self._fd = source.fileno()
        os.set_blocking(self._fd, False)
        self._log = log
        self._console = console
        self._prefix = prefix
        self._partial = b""
        self.closed = False

    def fileno(self) -> int:
        return self._fd

    def pump(self) -> bool:
        """Copy what the pipe holds now; False once the rank (and its children) closed it."""
        while not self.closed:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return True
            if not data:
                return False
            os.write(self._log.fileno(), data)
            self._show(data)
        return False

    def close(self) -> None:
        """Copy what is left, end a last unterminated line, and close the pipe."""
        if self.closed:
            return
        self.pump()
        if self._partial:
            self._write_lines([self._partial])
            self._partial = b""
        self._source.close()
        self.closed = True

    def _show(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > _MAX_LINE:
            lines.append(self._partial)
            self._partial = b""
        if lines:
            self._write_lines(lines)

    def _write_lines(self, lines: list[bytes]) -> None:
        try:
            self._console.write(b"".join(self._prefix + line + b"\n" for line in lines))
            self._console.flush()
        except (BrokenPipeError, ValueError):
            pass  # the console went away; the log file still has everything


def start_pumps(spec: RankSpec, logs: RankLogs, stdout: IO[bytes] | None,
                stderr: IO[bytes] | None) -> list[LinePump]:
    """Pumps for the teed streams of a just started rank (Popen's stdout/stderr pipes)."""
    prefix = f"[rank {spec.rank}] ".encode()
    pumps = []
    if stdout is not None and logs.stdout is not None:
        pumps.append(LinePump(stdout, logs.stdout, sys.stdout.buffer, prefix))
    if stderr is not None and logs.stderr is not None:
        pumps.append(LinePump(stderr, logs.stderr, sys.stderr.buffer, prefix))
    return pumps


def tail(path: Path, lines: int) -> list[str]:
    """The last lines of a file (at most its last 64 KiB), each ending in a newline."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line + "\n" for line in deque(text.splitlines(), maxlen=lines)]
