"""Supervisor: start this node's ranks, watch them, forward signals, tear down, report, restart.

The only module of the launcher that touches processes, sockets and signals. Each rank runs in a
session of its own so that the whole tree it starts (DataLoader workers, compilers, shells) can be
signalled as one process group; the watchdog kills those groups if the launcher itself is killed.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from lockstep.launcher.plan import LaunchPlan, Mode, RankSpec
from lockstep.launcher.watchdog import Watchdog

_FORWARDED = (signal.SIGINT, signal.SIGTERM)
_TAIL_LINES = 30


def _say(message: str) -> None:
    print(f"lockstep: {message}", file=sys.stderr, flush=True)


def describe_exit(code: int) -> str:
    """'exit code 3' or 'signal SIGSEGV' for a Popen returncode."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def shell_code(code: int) -> int:
    """The exit status a shell reports for a child's returncode (128 + N for signal N)."""
    return 128 - code if code < 0 else code


@dataclass
class _Rank:
    spec: RankSpec
    proc: subprocess.Popen
    pidfd: int | None
    files: list[IO]
    returncode: int | None = None

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session makes each rank the leader of its own group

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def signal_leader(self, signum: int) -> None:
        try:
            os.kill(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class _Failure:
    rank: _Rank
    code: int


class Supervisor:
    """Runs one LaunchPlan to completion and returns the launcher's exit code."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self._signals_seen: list[int] = []

    def run(self) -> int:
        listener = self._bind_store_socket() if self.plan.hosts_store else None
        if isinstance(listener, int):
            return listener  # a usage error, already reported
        port = listener.getsockname()[1] if listener else self.plan.master_port
        watchdog = Watchdog()  # forked first, so it inherits no handlers and no wakeup pipe
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous = {s: signal.signal(s, lambda *_: None) for s in _FORWARDED}
        old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        launcher_store = None
        try:
            if listener and self.plan.mode is Mode.COMMAND:
                launcher_store = _host_store_here(self.plan, listener)
            return self._run_attempts(port, listener, wake_r, watchdog, launcher_store is None)
        finally:
            watchdog.close()
            signal.set_wakeup_fd(old_wakeup)
            for s, handler in previous.items():
                signal.signal(s, handler)
            os.close(wake_r)
            os.close(wake_w)
            if listener:
                listener.close()

    def _run_attempts(self, port: int, listener, wake_r: int, watchdog: Watchdog, pass_fd: bool) -> int:
        for attempt in range(self.plan.max_restarts + 1):
            store_fd = listener.fileno() if (listener and pass_fd) else None
            ranks = self._spawn_all(port, attempt, store_fd, watchdog)
            outcome = self._monitor(ranks, wake_r)
            if outcome is None:
                self._teardown(ranks, wake_r, watchdog, signal.SIGTERM)
                return 0
            if isinstance(outcome, int):  # the launcher was signalled
                self._teardown(ranks, wake_r, watchdog, None)
                return 128 + outcome
            self._teardown(ranks, wake_r, watchdog, signal.SIGTERM)
            self._report(outcome, ranks)
            if self._signals_seen:
                return 128 + self._signals_seen[0]
            if attempt < self.plan.max_restarts:
                _say(f"restarting this node's ranks ({attempt + 1} of {self.plan.max_restarts})")
                continue
            return shell_code(outcome.code)
        raise AssertionError("unreachable")

    # -- starting ---------------------------------------------------------------------------

    def _bind_store_socket(self) -> socket.socket | int:
        """Bind and listen on the store port now, and keep it: no one can take it before rank 0."""
        multinode = self.plan.is_multinode
        host = "" if multinode else self.plan.master_addr
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.plan.master_port or 0))
        except OSError as e:
            sock.close()
            _say(f"error: cannot bind the store port {self.plan.master_port} on {host or '*'} "
                 f"({e.strerror}): pass another --master_port, or none on a single node")
            return 2
        sock.listen(max(128, self.plan.world_size))
        sock.set_inheritable(False)
        return sock

    def _spawn_all(self, port: int, attempt: int, store_fd: int | None, watchdog: Watchdog) -> list[_Rank]:
        base_env = {k: v for k, v in os.environ.items() if k != "LOCKSTEP_STORE_FD"}
        ranks = []
        for spec in self.plan.ranks:
            env = self.plan.worker_env(spec.local_rank, port, attempt, base_env)
            pass_fds: tuple[int, ...] = ()
            if spec.local_rank == 0 and store_fd is not None:
                env["LOCKSTEP_STORE_FD"] = str(store_fd)
                pass_fds = (store_fd,)
            ranks.append(self._spawn(spec, env, pass_fds, watchdog))
        if self.plan.verbose:
            for r in ranks:
                where = "console" if r.spec.stdout_path is None else f"{r.spec.stdout_path}, {r.spec.stderr_path}"
                _say(f"rank {r.spec.rank} (local {r.spec.local_rank}) pid {r.proc.pid} -> {where}")
        return ranks

    def _spawn(self, spec: RankSpec, env: dict[str, str], pass_fds: tuple[int, ...], watchdog: Watchdog) -> _Rank:
        files = _open_logs(spec)
        stdout = files[0] if files else None
        stderr = files[-1] if files else None
        proc = subprocess.Popen(
            self.plan.command(), env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            pass_fds=pass_fds, start_new_session=True,
        )
        watchdog.guard(proc.pid)
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = None  # no pidfd on this platform: the monitor polls instead
        return _Rank(spec, proc, pidfd, files)

    # -- watching -------------------------------------------------------------------------

    def _monitor(self, ranks: list[_Rank], wake_r: int) -> _Failure | int | None:
        """Wait until every rank exited 0 (None), one failed (_Failure), or a signal came (int)."""
        with _Waiter(ranks, wake_r) as waiter:
            while any(r.returncode is None for r in ranks):
                signals, exited = waiter.wait(None)
                if signals:
                    self._signals_seen.extend(signals)
                    self._forward(ranks, signals[0])
                    return signals[0]
                for r in exited:
                    if r.returncode != 0:
                        return _Failure(r, r.returncode)
                    if self.plan.verbose:
                        _say(f"rank {r.spec.rank} finished")
        return None

    def _forward(self, ranks: list[_Rank], signum: int) -> None:
        _say(f"received {signal.Signals(signum).name}, forwarding it to every rank")
        for r in ranks:
            if r.returncode is None:
                # SIGTERM asks the rank itself to stop (the Trainer saves a checkpoint), so its
                # dataloader workers must live on meanwhile; the teardown kills the group after.
                # SIGINT goes to the whole group, as a terminal's Ctrl-C would.
                if signum == signal.SIGTERM:
                    r.signal_leader(signum)
                else:
                    r.signal_group(signum)

    def _teardown(self, ranks: list[_Rank], wake_r: int, watchdog: Watchdog, first: int | None) -> None:
        """Signal the live ranks (unless already done), give them the grace period, then SIGKILL."""
        if first is not None:
            for r in ranks:
                if r.returncode is None:
                    r.signal_group(first)
        deadline = time.monotonic() + self.plan.grace_period
        with _Waiter(ranks, wake_r) as waiter:
            while any(r.returncode is None for r in ranks):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                signals, _ = waiter.wait(remaining)
                if signals:
                    self._signals_seen.extend(signals)
                    _say("second signal: killing every rank now")
                    break
        for r in ranks:
            # Also when the rank itself is gone: children it left in its group die with it.
            r.signal_group(signal.SIGKILL)
            r.proc.wait()
            r.returncode = r.proc.returncode if r.returncode is None else r.returncode
            watchdog.forget(r.pgid)
            for f in r.files:
                f.close()
            if r.pidfd is not None:
                os.close(r.pidfd)

    # -- reporting ------------------------------------------------------------------------

    def _report(self, failure: _Failure, ranks: list[_Rank]) -> None:
        r = failure.rank
        _say(f"rank {r.spec.rank} (local rank {r.spec.local_rank}, pid {r.proc.pid}) failed first "
             f"with {describe_exit(failure.code)}")
        if r.spec.stderr_path is not None:
            shown = r.spec.stderr_path
            lines = _tail(shown)
            if not lines and r.spec.stdout_path is not None:
                shown = r.spec.stdout_path
                lines = _tail(shown)
            if lines:
                _say(f"last {len(lines)} lines of rank {r.spec.rank}'s output ({shown}):")
                sys.stderr.write("".join(f"  | {line}" for line in lines))
            else:
                _say(f"rank {r.spec.rank} wrote nothing to {shown}")
        else:
            _say(f"rank {r.spec.rank}'s output is on the console above")
        stopped = [f"{o.spec.rank} ({describe_exit(o.returncode)})" for o in ranks
                   if o is not r and o.returncode not in (0, None)]
        if stopped:
            _say("other ranks ended: " + ", ".join(stopped))


class _Waiter:
    """Blocks until a rank exits or a signal arrives; pidfds where the kernel has them, else polling."""

    def __init__(self, ranks: list[_Rank], wake_r: int) -> None:
        self._ranks = ranks
        self._wake_r = wake_r
        self._selector = selectors.DefaultSelector()
        self._polling = any(r.pidfd is None for r in ranks)

    def __enter__(self) -> _Waiter:
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        for r in self._ranks:
            if r.pidfd is not None and r.returncode is None:
                self._selector.register(r.pidfd, selectors.EVENT_READ)
        return self

    def __exit__(self, *exc: object) -> None:
        self._selector.close()

    def wait(self, timeout: float | None) -> tuple[list[int], list[_Rank]]:
        if self._polling:
            timeout = 0.05 if timeout is None else min(timeout, 0.05)
        ready = {key.fd for key, _ in self._selector.select(timeout)}
        signals: list[int] = []
        if self._wake_r in ready:
            try:
                signals = [s for s in os.read(self._wake_r, 64) if s in _FORWARDED]
            except BlockingIOError:
                pass
        exited = []
        for r in self._ranks:
            if r.returncode is None and r.proc.poll() is not None:
                r.returncode = r.proc.returncode
                if r.pidfd is not None:
                    self._selector.unregister(r.pidfd)
                exited.append(r)
        return signals, exited


def _open_logs(spec: RankSpec) -> list[IO]:
    if spec.stdout_path is None:
        return []
    paths = [spec.stdout_path, spec.stderr_path]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    out = open(spec.stdout_path, "ab")
    if spec.stderr_path == spec.stdout_path:
        return [out]
    return [out, open(spec.stderr_path, "ab")]


def _tail(path: Path, lines: int = _TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line + "\n" for line in deque(text.splitlines(), maxlen=lines)]


def _host_store_here(plan: LaunchPlan, listener: socket.socket):
    """-c runs arbitrary commands, not our bootstrap, so the launcher hosts the store itself."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(plan.master_addr, listener.getsockname()[1], plan.world_size, True,
                    datetime.timedelta(seconds=1800), wait_for_workers=False,
                    master_listen_fd=listener.fileno())
