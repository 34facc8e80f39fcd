"""Stopping this node's ranks: the launcher's signals, the teardown, and the exit code after a stop.

Signals to the launcher: SIGINT, SIGTERM and SIGHUP are forwarded and stop the job; SIGUSR1 and
SIGUSR2 are passed on to each rank's main process and the job goes on; SIGQUIT (the supervisor
prints every rank's stacks) leaves the job running too. The handlers only wake the supervisor:
each signal's number arrives as a byte on a pipe that it selects on with the ranks.

The teardown, after any end of the job, gives the live ranks the grace period and then SIGKILLs
every process of the job (:mod:`tree`): each rank's process group, and whatever left it, since
as a subreaper the launcher adopts every orphan below it. After a stopping signal, a rank it had
to kill counts as stopped as asked: the kill was the launcher's doing, and the report says so
instead of blaming the rank.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lockstep.launcher.ranks import Rank, Waiter
from lockstep.launcher.report import report_failure, say, shell_code
from lockstep.launcher.tree import below_me, job_processes, kill_job, reap_adopted, signal_job
from lockstep.launcher.watchdog import Watchdog

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)
HANDLED = (*STOPPING, *PASSED_ON, signal.SIGQUIT)


@contextmanager
def caught_signals() -> Iterator[int]:
    """Catch the HANDLED signals for the block; yields the pipe's read end that their numbers reach."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    previous = {s: signal.signal(s, lambda *_: None) for s in HANDLED}
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        yield wake_r
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(wake_r)
        os.close(wake_w)


def forward(ranks: list[Rank], signum: int) -> None:
    """Pass a stopping signal on to every live rank."""
    say(f"received {signal.Signals(signum).name}, forwarding it to every rank")
    for r in ranks:
        if r.returncode is None:
            # SIGTERM asks the rank itself to stop (the Trainer saves a checkpoint), so its
            # dataloader workers must live on meanwhile; the teardown kills the group after.
            # SIGINT goes to the whole group, as a terminal's Ctrl-C would.
            if signum == signal.SIGTERM:
                r.signal_leader(signum)
            else:
                r.signal_group(signum)


def pass_on(ranks: list[Rank], signum: int) -> None:
    """A signal the job should see but not stop for (a batch scheduler's warning)."""
    say(f"received {signal.Signals(signum).name}, passing it to every rank; the job goes on")
    for r in ranks:
        if r.returncode is None:
            r.signal_leader(signum)


def teardown(ranks: list[Rank], wake_r: int, watchdog: Watchdog, grace_period: float,
             first: int | None, spare: tuple[int, ...] = ()) -> list[int]:
    """Signal the job with ``first`` (unless None: already done), give the live ranks the grace
    period, then SIGKILL every process of the job but ``spare`` (the launcher's own helpers, as the
    prefork server that the next attempt's ranks fork from); the stopping signals that came meanwhile."""
    spare = (watchdog.pid, *spare)
    if first is not None:
        _signal_job(ranks, watchdog, first, spare)
    deadline = time.monotonic() + grace_period
    stopping: list[int] = []
    with Waiter(ranks, wake_r, HANDLED) as waiter:
        while any(r.returncode is None for r in ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            signals, _ = waiter.wait(remaining)
            stopping = [s for s in signals if s in STOPPING]
            if stopping:
                say("second signal: killing every rank now")
                break
    why = "had not exited at the second signal" if stopping else \
        f"did not exit within the {grace_period:g} s grace period (--grace_period)"
    kill_job(below_me(watchdog.mark), spare=spare, mine=True)
    for r in ranks:
        _kill(r, watchdog, why)
    reap_adopted(keep=spare)  # every rank is waited for by now: only orphans are left
    return stopping


def _signal_job(ranks: list[Rank], watchdog: Watchdog, signum: int, spare: tuple[int, ...]) -> None:
    """``signum`` to each live rank's group, and once to every other process of the job but ``spare``."""
    groups = {r.pgid for r in ranks if r.returncode is None}
    for r in ranks:
        if r.returncode is None:
            r.signal_group(signum)
    others = []
    for pid in job_processes(below_me(watchdog.mark), (os.getpid(),), spare):
        try:
            if os.getpgid(pid) not in groups:
                others.append(pid)
        except ProcessLookupError:
            pass
    signal_job(others, signum)


def _kill(rank: Rank, watchdog: Watchdog, why: str) -> None:
    """Wait for the rank, killed with the rest of the job, and close its files. Its group is
    SIGKILLed once more, in case a process in D state outlasted the job's kill."""
    running = rank.returncode is None
    rank.signal_group(signal.SIGKILL)
    rank.proc.wait()
    if running:
        rank.returncode = rank.proc.returncode
        if rank.returncode == -signal.SIGKILL:
            rank.killed = why
    watchdog.forget(rank.pgid)
    rank.close()


def signalled_code(ranks: list[Rank], signum: int) -> int:
    """128 + ``signum`` when every rank stopped as asked: it finished, it exited 128 + signum
    (the Trainer does after its preemption checkpoint is committed), the signal killed it, or the
    teardown did after the grace period (said, as the launcher's doing, not the rank's failure).
    Otherwise the first other rank's code, with a report: a preemption that did not commit its
    checkpoint must not look clean to the scheduler."""
    name = signal.Signals(signum).name
    killed = [r for r in ranks if r.killed]
    if killed:
        who = ", ".join(str(r.spec.rank) for r in killed)
        say(f"after {name}, rank{'s' if len(killed) > 1 else ''} {who} {killed[0].killed} and "
            f"{'were' if len(killed) > 1 else 'was'} killed")
    clean = (0, 128 + signum, -signum)
    bad = next((r for r in ranks if r.returncode not in clean and not r.killed), None)
    if bad is None:
        return 128 + signum
    say(f"after {name}, rank {bad.spec.rank} did not stop cleanly, so a "
        f"checkpoint it should have written on the way out may be missing")
    others = [(o.spec.rank, o.returncode) for o in ranks if o is not bad]
    report_failure(bad.spec, bad.proc.pid, bad.returncode, others)  # type: ignore[arg-type]
    return shell_code(bad.returncode)  # type: ignore[arg-type]
