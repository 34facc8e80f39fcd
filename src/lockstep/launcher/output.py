"""Where a rank's output goes: the console, its log files, or both (``--tee``).

A stream that is not teed is handed to the rank as a file descriptor (the console's or a log
file's), so the launcher never copies it. A teed stream goes through a pipe that the supervisor
drains with :class:`LinePump`, which appends the bytes to the rank's log file as they come and
writes each complete line to the launcher's console behind torchrun's prefix (``[default0]:``).

On several nodes, local rank 0's console streams also go through a pipe, drained by
:class:`ConsolePump`: it passes the bytes to the console unchanged and keeps the last ones, so
that the other nodes can show its last lines if it fails. A stream whose console is a terminal
is left alone: behind a pipe, the rank would stop writing colours and redrawing progress bars.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from lockstep.launcher.plan import LaunchError, LaunchPlan, RankSpec, Stream

_READ_SIZE = 64 * 1024
_MAX_LINE = 64 * 1024  # a longer line without a newline (a progress bar) is shown in pieces
_KEPT_BYTES = 16 * 1024  # of a console stream, for the tail that other nodes show


@dataclass
class RankLogs:
    """The open log files of one rank; None for a stream that goes to the console only."""

    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def close(self) -> None:
        for f in {id(f): f for f in (self.stdout, self.stderr) if f is not None}.values():
            f.close()


def prepare_run_directory(plan: LaunchPlan, attempt: int = 0) -> list[RankSpec]:
    """Create the run directory (with --log-dir, torchrun's folders of this attempt, emptied as
    torchrun does), remove error files an earlier attempt left, and return the attempt's ranks."""
    specs = plan.rank_specs(attempt)
    try:
        plan.run_directory.mkdir(parents=True, exist_ok=True)
        if plan.torchrun_logs is not None:
            attempt_dir = plan.torchrun_logs / f"attempt_{attempt}"
            shutil.rmtree(attempt_dir, ignore_errors=True)
            for spec in specs:
                spec.error_file.parent.mkdir(parents=True)
        for spec in specs:
            spec.error_file.unlink(missing_ok=True)
    except OSError as e:
        raise LaunchError(f"--run_directory {str(plan.run_directory)!r} cannot be used "
                          f"({e.strerror}): pass a folder you can write to") from None
    return specs


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
    try:
        for name, target in spec.links:
            _link(name, target)
    except OSError as e:
        for f in files.values():
            f.close()
        raise LaunchError(f"cannot name rank {spec.rank}'s log {str(name)!r} ({e.strerror}): "
                          f"pass writable --stdout/--stderr paths") from None
    return RankLogs(*opened)


def _link(name: Path, target: Path) -> None:
    """``name`` becomes another name of ``target`` (a hard link; across file systems a symbolic one)."""
    name.parent.mkdir(parents=True, exist_ok=True)
    name.unlink(missing_ok=True)
    try:
        os.link(target, name)
    except OSError:
        os.symlink(os.path.abspath(target), name)


def console_streams(spec: RankSpec) -> Stream:
    """The streams of this rank that appear on the launcher's console."""
    shown = spec.tee
    if spec.stdout_path is None:
        shown |= Stream.STDOUT
    if spec.stderr_path is None:
        shown |= Stream.STDERR
    return shown


def kept_streams(spec: RankSpec) -> Stream:
    """The rank's console-only streams whose console is not a terminal: the ones a ConsolePump may
    carry (a terminal must stay the rank's own, see the module's docstring)."""
    kept = Stream.NONE
    for stream, path, console in ((Stream.STDOUT, spec.stdout_path, sys.stdout),
                                  (Stream.STDERR, spec.stderr_path, sys.stderr)):
        if path is None and not _is_terminal(console):
            kept |= stream
    return kept


def _is_terminal(console: IO[str] | None) -> bool:
    try:
        return console is None or os.isatty(console.fileno())
    except (OSError, ValueError):
        return True  # no usable descriptor: leave the stream as it is


class Pump:
    """Drains one rank's piped stream as it comes (the supervisor selects on it)."""

    def __init__(self, source: IO[bytes], console: BinaryIO) -> None:
        self._source = source
        self._fd = source.fileno()
        os.set_blocking(self._fd, False)
        self._console = console
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
            self._take(data)
        return False

    def close(self) -> None:
        """Copy what is left and close the pipe."""
        if self.closed:
            return
        self.pump()
        self._finish()
        self._source.close()
        self.closed = True

    def _take(self, data: bytes) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        """Called once the pipe is drained for good."""

    def _write(self, data: bytes) -> None:
        try:
            self._console.write(data)
            self._console.flush()
        except (BrokenPipeError, ValueError):
            pass  # the console went away; a log file, if any, still has everything


class LinePump(Pump):
    """Copies one rank's piped stream to its log file and, line by line, to the console."""

    def __init__(self, source: IO[bytes], log: IO[bytes], console: BinaryIO, prefix: bytes) -> None:
        super().__init__(source, console)
        self._log = log
        self._prefix = prefix
        self._partial = b""

    def _take(self, data: bytes) -> None:
        os.write(self._log.fileno(), data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > _MAX_LINE:
            lines.append(self._partial)
            self._partial = b""
        if lines:
            self._write_lines(lines)

    def _finish(self) -> None:
        if self._partial:  # end a last unterminated line
            self._write_lines([self._partial])
            self._partial = b""

    def _write_lines(self, lines: list[bytes]) -> None:
        self._write(b"".join(self._prefix + line + b"\n" for line in lines))


class ConsolePump(Pump):
    """Passes one rank's stream to the console unchanged, keeping its last bytes."""

    def __init__(self, source: IO[bytes], console: BinaryIO, stream: Stream) -> None:
        super().__init__(source, console)
        self.stream = stream
        self._kept = bytearray()

    def _take(self, data: bytes) -> None:
        self._write(data)
        self._kept += data
        if len(self._kept) > 2 * _KEPT_BYTES:  # trimmed now and then, not at every read
            del self._kept[:-_KEPT_BYTES]

    def last_lines(self, count: int) -> list[str]:
        """The last ``count`` lines that passed, each ending in a newline."""
        text = self._kept[-_KEPT_BYTES:].decode(errors="replace")
        return [line + "\n" for line in deque(text.splitlines(), maxlen=count)]


def start_pumps(spec: RankSpec, logs: RankLogs, stdout: IO[bytes] | None,
                stderr: IO[bytes] | None) -> list[Pump]:
    """Pumps for the piped streams of a just started rank (Popen's stdout/stderr pipes): a teed
    stream has a log file, a kept one (:func:`kept_streams`) has none."""
    prefix = spec.prefix.encode()
    pumps: list[Pump] = []
    for stream, pipe, log, console in ((Stream.STDOUT, stdout, logs.stdout, sys.stdout.buffer),
                                       (Stream.STDERR, stderr, logs.stderr, sys.stderr.buffer)):
        if pipe is None:
            continue
        pumps.append(LinePump(pipe, log, console, prefix) if log is not None else ConsolePump(pipe, console, stream))
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
