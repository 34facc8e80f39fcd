"""Background threads (the checkpoint writer, loggers' writers) that take CPU only where training
leaves it idle, and hand the interpreter lock back quickly."""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Iterator

SWITCH_INTERVAL = 0.0005
"""Seconds a thread that wants the interpreter lock waits before asking its holder to let go, while
a background write runs (Python's default is 0.005)."""
FALLBACK_NICENESS = 10
"""How much lower than training a background thread runs where it cannot be made idle-only
(``nice`` steps, 19 the lowest)."""


AUTOGROUP_NICENESS = 19
"""The niceness of the session a background process leaves its rank's for (:func:`out_of_a_ranks_session`)."""


def out_of_a_ranks_session(rank_pid: int) -> None:
    """Move this background process (a child of the rank ``rank_pid``) into a session of its own
    with the smallest share of the CPU, where the rank leads its own session and the kernel shares
    CPU between sessions first (``sched_autogroup``); elsewhere leave it where it is.

    torchrun starts each rank in a session of its own. In its rank's session an idle-only process
    is below that rank only: while the rank waits for the others in a collective, the session's
    whole share goes to the background process, against the session of the rank being waited for.
    In a session of its own at niceness 19 it weighs 15 against a rank's 1024 there. lockstep's
    launcher keeps its ranks in its own session, where this is not needed and not done. The process
    still dies with its rank (``PR_SET_PDEATHSIG``), not with the rank's process group.
    """
    if sys.platform != "linux" or os.getsid(0) != rank_pid:
        return
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() != "1":
                return
        os.setsid()
    except OSError:
        return
    # Without CAP_SYS_ADMIN the kernel takes one such write a machine per 100 ms (EAGAIN otherwise),
    # and every rank starts its upload process at about the same moment.
    for _ in range(50):
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(AUTOGROUP_NICENESS))
            return
        except BlockingIOError:
            time.sleep(0.1 + random.random() * 0.1)
        except OSError:
            break
    print(f"lockstep: upload process {os.getpid()} could not lower its session's CPU share; "
          "it competes with the ranks as an equal", file=sys.stderr)


def yield_to_training(idle_only: bool = True) -> None:
    """Make the calling thread run only on a core that would otherwise be idle (``idle_only``), or
    at a lower priority than training.

    On Linux a thread has its own scheduling policy: under ``SCHED_IDLE`` it gets a core only when
    no ordinary thread wants it, so while every core trains, a background write waits for the
    moments a rank waits on the network instead of taking a share of the step (a nice value only
    shrinks that share). Waiting for the write (the next save, the end of training) leaves a core
    idle, so it always finishes. A thread that meets other ranks' threads in collectives should not
    be ``idle_only``: on cores that never idle it could come so late that the collective times out.
    Where the policy is refused, the thread runs at a lower priority; elsewhere it is left as it is.
    """
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    if idle_only:
        try:
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, thread, FALLBACK_NICENESS)
    except OSError:
        pass


@contextlib.contextmanager
def short_lock_turns() -> Iterator[None]:
    """Within this block (a background write), the training thread waits at most
    :data:`SWITCH_INTERVAL` for the interpreter lock.

    The training thread lets go of the lock in every torch call and takes it back after: when a
    writer thread holds it then, running Python (pickling a checkpoint), the training thread waits
    out the whole switch interval, 5 ms by default, which is a third of a small step. The interval is
    process-wide: it is put back when the block ends, so only one such block should run at a time.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
