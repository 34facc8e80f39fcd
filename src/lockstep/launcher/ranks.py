"""A rank's process on this node: how it starts, how it is signalled, and waiting for it.

Each rank leads a process group of its own so that the whole tree it starts (DataLoader workers,
compilers, shells) can be signalled as one. The groups stay in the launcher's session: where the
kernel shares CPU between sessions first (``sched_autogroup``, on by default in many distributions),
a rank in a session of its own (as torchrun starts them) competes as a whole session with every
other one, so work that should only take idle CPU in other sessions (another rank's upload process, a
storage server on the node) takes a fair share of the ranks' cores instead. Ranks are then in
background groups of the launcher's terminal, if it has one: :func:`no_terminal_stops`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from lockstep.launcher import tree
from lockstep.launcher.output import ConsolePump, Pump, RankLogs, kept_streams, start_pumps
from lockstep.launcher.plan import LaunchPlan, RankSpec, Stream
from lockstep.launcher.prefork import ForkedRank, PreforkServer, command_forkable
from lockstep.launcher.report import TRACEBACK_LINES
from lockstep.launcher.watchdog import Watchdog

__all__ = ["Rank", "Waiter", "no_terminal_stops", "spawn"]

# Test hook: seconds to pause right after each Popen, where a launcher killed used to orphan a rank.
PAUSE_AFTER_SPAWN_ENV = "_LOCKSTEP_TEST_PAUSE_AFTER_SPAWN"


@dataclass
class Rank:
    """One rank's process on this node, its log files and the pumps that copy its teed output."""

    spec: RankSpec
    proc: subprocess.Popen | ForkedRank
    pidfd: int | None
    logs: RankLogs
    pumps: list[Pump] = field(default_factory=list)
    returncode: int | None = None
    killed: str = ""
    """Why the teardown SIGKILLed it while it still ran ("" if it did not): its end was the launcher's doing."""

    def kept(self) -> dict[Stream, list[str]]:
        """The last lines of its console streams that passed through the launcher."""
        return {p.stream: p.last_lines(TRACEBACK_LINES) for p in self.pumps if isinstance(p, ConsolePump)}

    @property
    def pgid(self) -> int:
        return self.proc.pid  # process_group=0 makes each rank the leader of its own group

    def signal_group(self, signum: int) -> None:
        """``signum`` to the rank's process group: its leftovers too once the rank exited, but never
        a group that another process leads with the rank's pid, free again once the rank was reaped
        and its group emptied (:func:`tree.still_ours`)."""
        if self.proc.returncode is not None and not tree.still_ours(self.pgid, None):
            return
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def signal_leader(self, signum: int) -> None:
        if self.proc.returncode is not None:
            return  # reaped: its pid may be another process's now
        try:
            os.kill(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        for pump in self.pumps:
            pump.close()
        self.logs.close()
        if self.pidfd is not None:
            os.close(self.pidfd)


def spawn(plan: LaunchPlan, spec: RankSpec, logs: RankLogs, env: dict[str, str], pass_fds: tuple[int, ...],
          watchdog: Watchdog, prefork: PreforkServer | None = None) -> Rank:
    """Start one rank in a process group of its own, registered with the watchdog before it runs:
    forked by ``prefork`` where there is one and it can, else a fresh interpreter."""
    # Other nodes show local rank 0's last lines only if they pass through this launcher.
    piped = spec.tee | (kept_streams(spec) if plan.is_multinode else Stream.NONE)
    # preexec_fn with threads (-c's launcher-hosted store): register_child only formats a few
    # bytes and writes them, taking no lock another thread could hold.
    command = plan.command()
    stdout = subprocess.PIPE if piped & Stream.STDOUT else logs.stdout
    stderr = subprocess.PIPE if piped & Stream.STDERR else logs.stderr
    proc: subprocess.Popen | ForkedRank | None = None
    if prefork is not None and command_forkable(command, plan.python):
        proc = prefork.spawn(command, env, stdout, stderr, pass_fds)
    if proc is None:
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            pass_fds=pass_fds, process_group=0, preexec_fn=watchdog.register_child,  # noqa: PLW1509
        )
    if pause := os.environ.get(PAUSE_AFTER_SPAWN_ENV):
        time.sleep(float(pause))
    try:
        pidfd: int | None = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None  # no pidfd on this platform: the monitor polls instead
    return Rank(spec, proc, pidfd, logs, start_pumps(spec, logs, proc.stdout, proc.stderr))


@contextlib.contextmanager
def no_terminal_stops() -> Iterator[None]:
    """Ignore SIGTTIN and SIGTTOU for the block, in the launcher and (inherited) in the ranks it starts.

    A rank in a background group of a terminal's session is stopped when it writes to that terminal
    with ``stty tostop`` set, changes its settings, or reads from it: a job that hangs. Ignored, the
    write and the change go through and a read fails at once (``EIO``) instead.
    """
    signals = (signal.SIGTTIN, signal.SIGTTOU)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Waiter:
    """Blocks until a rank exits or a signal arrives, copying teed output meanwhile.

    pidfds where the kernel has them, else polling. Each byte on ``wake_r`` is a signal number the
    launcher's handler wrote; those in ``handled`` are returned.
    """

    def __init__(self, ranks: list[Rank], wake_r: int, handled: tuple[int, ...]) -> None:
        self._ranks = ranks
        self._wake_r = wake_r
        self._handled = handled
        self._selector = selectors.DefaultSelector()
        self._polling = any(r.pidfd is None for r in ranks)

    def __enter__(self) -> Waiter:
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        for r in self._ranks:
            if r.pidfd is not None and r.returncode is None:
                self._selector.register(r.pidfd, selectors.EVENT_READ)
            for pump in r.pumps:
                if not pump.closed:
                    self._selector.register(pump, selectors.EVENT_READ)
        return self

    def __exit__(self, *exc: object) -> None:
        self._selector.close()

    def add(self, rank: Rank) -> None:
        """Wait for ``rank`` too, started after this waiter (in place of one in its list)."""
        self._polling = self._polling or rank.pidfd is None
        if rank.pidfd is not None:
            self._selector.register(rank.pidfd, selectors.EVENT_READ)
        for pump in rank.pumps:
            if not pump.closed:
                self._selector.register(pump, selectors.EVENT_READ)

    def wait(self, timeout: float | None) -> tuple[list[int], list[Rank]]:
        """The signals that arrived and the ranks that exited, within ``timeout`` seconds."""
        if self._polling:
            timeout = 0.05 if timeout is None else min(timeout, 0.05)
        ready = [key.fileobj for key, _ in self._selector.select(timeout)]
        signals: list[int] = []
        for source in ready:
            if isinstance(source, Pump) and not source.pump():
                self._selector.unregister(source)
                source.close()
            elif source == self._wake_r:
                try:
                    signals = [s for s in os.read(self._wake_r, 64) if s in self._handled]
                except BlockingIOError:
                    pass
        exited = []
        registered = self._selector.get_map()
        for r in self._ranks:
            if r.returncode is None and r.proc.poll() is not None:
                r.returncode = r.proc.returncode
                for pump in r.pumps:
                    pump.pump()  # what it printed last appears before the launcher's report
                exited.append(r)
            # also a rank whose exit another Waiter took (the supervisor's, during a store call):
            # its pidfd stays readable and would wake this one at once, again and again
            if r.returncode is not None and r.pidfd is not None and r.pidfd in registered:
                self._selector.unregister(r.pidfd)
        return signals, exited
