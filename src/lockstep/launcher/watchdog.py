"""Orphan guard: a forked helper that kills every process of the job if the launcher dies.

The launcher may be killed with SIGKILL, which it cannot catch. The watchdog holds the read end of
a pipe whose write end only the launcher has; when the launcher dies, for any reason, the kernel
closes that end, the watchdog reads EOF and SIGKILLs every process of the job (:mod:`tree`): each
rank it was told about and all that descends from it, however it groups itself, and every process
that carries the launcher's mark in its environment, also one whose parent died before the
launcher did (the launcher had adopted it as their subreaper; at its death init takes it). It runs
in its own session so that killing the launcher's process group does not take it along. Then it
removes the launcher's control folder (in ``/dev/shm``, memory), which the launcher, killed, could
not.

Each rank registers *itself*, between fork and exec (Popen's ``preexec_fn``), so no instant exists
in which a rank runs unguarded: had the launcher registered the pid after Popen returned, a SIGKILL
in between would leave the rank running forever. The child still holds a copy of the pipe's write
end until exec closes it, so even if the launcher dies first, the watchdog reads the registration
before it sees EOF.
"""

from __future__ import annotations

import os
import shutil
import signal

from lockstep.launcher.tree import kill_job, signal_group, start_time, still_ours


class Watchdog:
    """Launcher-side handle: register each rank's process group, forget it once it is gone.
    ``mark``: the one :func:`~lockstep.launcher.tree.marked` puts in the ranks' environment."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        read_fd, self._write_fd = os.pipe()
        # Forked before any thread exists, so the child is a plain copy with nothing half-locked.
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._write_fd)
            _watch(read_fd, mark)
        os.close(read_fd)
        os.set_inheritable(self._write_fd, False)

    @property
    def write_fd(self) -> int:
        """The pipe's write end, for a process that starts ranks for the launcher (a prefork server)
        and registers each as :meth:`register_child` does."""
        return self._write_fd

    def guard(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def register_child(self) -> None:
        """Popen's ``preexec_fn`` for a rank that leads its own process group: guard that group."""
        # Only a pipe write of a few bytes (atomic below PIPE_BUF): safe between fork and exec.
        os.write(self._write_fd, b"+%d\n" % os.getpid())

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def remove_at_death(self, folder: str | None) -> None:
        """Have the watchdog remove ``folder`` after it killed the job (None: no longer; the
        launcher removed it itself)."""
        self._send(f"d{folder or ''}\n")

    def close(self) -> None:
        """Normal shutdown: the watchdog sees EOF with nothing left to kill and exits."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
            os.waitpid(self.pid, 0)

    def _send(self, line: str) -> None:
        os.write(self._write_fd, line.encode())


def _watch(read_fd: int, mark: str) -> None:
    """Child side; never returns."""
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, read_fd)
        os.closerange(read_fd + 1, 65536)
        groups: dict[int, int | None] = {}  # each guarded group, and when its leader started
        folder, buffer = "", b""
        while chunk := os.read(read_fd, 4096):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line[:1] == b"d":
                    folder = line[1:].decode()
                elif line[:1] == b"+":
                    groups[int(line[1:])] = start_time(int(line[1:]))
                else:
                    groups.pop(int(line[1:]), None)
        # A rank that exited long before the launcher (lost in an elastic job, say) left its pid free:
        # a process that took it since is another's, and so is what descends from it.
        ours = {pgid: started for pgid, started in groups.items() if still_ours(pgid, started)}
        # Walk down from the ranks before killing any: a child without the mark is found through them.
        kill_job(mark, roots=ours)
        for pgid, started in ours.items():  # a rank killed between fork and exec does not carry the mark yet
            signal_group(pgid, signal.SIGKILL, started)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        os._exit(0)
