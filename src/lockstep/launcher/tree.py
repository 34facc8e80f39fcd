"""Every process of a job, however it groups itself: found through /proc, signalled, reaped.

A rank's descendants may leave its process group, even its session (a compiler driver started in a
group of its own, a helper started with ``start_new_session``, a daemon that forks twice), so
signalling process groups misses them, and once their parent exits the kernel hands them to init.
Two marks keep them findable:

* the launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant whose parent exits
  is re-parented to the launcher instead of init, so while the launcher lives every process of the
  job hangs below it in /proc's parent links;
* every rank's environment carries the launcher's mark (``LOCKSTEP_TREE``), which children inherit:
  the watchdog, which outlives a SIGKILLed launcher (whose tree is then handed to init), finds the
  job's processes by it, and by walking down from the ranks it guards before it kills any of them.

A process of the job is one that carries the mark, or descends from the launcher (or from a rank,
for the watchdog). Parent links come from each ``/proc/<pid>/stat``: ``/proc/<pid>/task/*/children``
needs a kernel option that not every kernel has.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

__all__ = ["MARK_ENV", "Reaper", "alive", "become_subreaper", "below_me", "job_processes", "kill_job", "marked", "new_mark",
           "reap_adopted", "signal_group", "signal_job", "start_time", "still_ours"]

MARK_ENV = "LOCKSTEP_TREE"
"""Marks of the launchers a process runs under, ``:``-separated (a launcher inside a rank adds its own)."""
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_KILL_POLL_S = 0.02


def new_mark() -> str:
    """A mark no other launcher uses: this pid and 64 random bits."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


def marked(env: Mapping[str, str], mark: str) -> dict[str, str]:
    """``env`` with ``mark`` added to the marks it already has."""
    marks = [m for m in env.get(MARK_ENV, "").split(":") if m]
    return {**env, MARK_ENV: ":".join([*marks, mark])}


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children, not init's (Linux 3.4+)."""
    if sys.platform != "linux":
        return False
    try:
        return ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def below_me(mark: str) -> str | None:
    """The mark to look for when this process kills its descendants: none where it is a subreaper,
    since then every process of the job is below it, and reading every process's environment
    costs tens of milliseconds on a node that runs thousands."""
    if sys.platform != "linux":
        return mark
    flag = ctypes.c_int(0)
    try:
        if ctypes.CDLL(None).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
            return mark
    except (OSError, AttributeError):
        return mark
    return None if flag.value else mark


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process now (``z``: a zombie whose threads still exit)."""
    table: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                # the command name may hold spaces and parentheses: the fields follow its last ')'
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # gone meanwhile
        table[int(name)] = (int(ppid), "z" if state == b"Z" and _threads_left(name) else state.decode())
    return table


def _threads_left(pid: int | str) -> bool:
    """Whether a zombie's other threads still run (a thread in uninterruptible sleep, say, after
    SIGKILL): its main thread shows ``Z`` already, but the process keeps its files, and so its
    locks, until the last thread is gone. Such a process counts as live (state ``z``)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: neither gone nor a zombie whose every thread has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return False
    return state != b"Z" or _threads_left(pid)


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None where there is none: with
    the pid, what tells one process from a later one that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def still_ours(pgid: int, started: int | None) -> bool:
    """Whether process group ``pgid``, whose leader started at ``started`` (None: it was gone, or
    reaped), may still be signalled as the job's. A pid is free for a new process once its process
    and every member of its group are gone; a process there now that is not the leader is another
    one, which may lead a group of its own (every rank does), so that group is not the job's. A
    group whose leader is gone and whose pid nobody holds is the job's leftovers, or empty."""
    now = start_time(pgid)
    return now is None or now == started


def signal_group(pgid: int, signum: int, started: int | None) -> None:
    """``signum`` to process group ``pgid`` if it is :func:`still_ours`."""
    if still_ours(pgid, started):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def _carries(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # gone, or another user's
        return False
    for entry in environ.split(b"\0"):
        if entry.startswith(MARK_ENV.encode() + b"="):
            return mark in entry[len(MARK_ENV) + 1:].split(b":")
    return False


def job_processes(mark: str | None, roots: Iterable[int] = (), spare: Iterable[int] = ()) -> set[int]:
    """Live (not zombie) processes that carry ``mark`` (None: not looked for) or descend from one
    of them or from ``roots`` (this process as a root: its descendants); never ``spare``, what
    descends from it, or this process."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    me = os.getpid()
    skip = {me, *spare}
    todo = [] if mark is None else [p for p in table if p not in skip and _carries(p, mark.encode())]
    for root in roots:
        todo.extend(children.get(me, ()) if root == me else (root,) if root in table else ())
    found: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in found or pid in skip:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return {p for p in found if table[p][1] != "Z"}


def signal_job(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def kill_job(mark: str | None, roots: Iterable[int] = (), spare: Iterable[int] = (), *, mine: bool = False,
             deadline_s: float = 5.0) -> set[int]:
    """SIGKILL every process of the job (``mine``: this process's descendants too) until none is
    left or ``deadline_s`` passed (a process in uninterruptible sleep dies only when it wakes);
    the processes still alive then.

    Each round finds the processes before it kills any, so a child is found through its parent
    even if it does not carry the mark. ``roots`` count in the first round only: once killed, their
    pids may be reused by processes that are not the job's."""
    me = (os.getpid(),) if mine else ()
    until = time.monotonic() + deadline_s
    left = job_processes(mark, (*me, *roots), spare)
    while left:
        signal_job(left, signal.SIGKILL)
        if time.monotonic() >= until:
            break
        time.sleep(_KILL_POLL_S)
        left = job_processes(mark, me, spare)
    return left


def reap_adopted(keep: Iterable[int]) -> None:
    """Collect the exit of every child that died and that this process did not start itself: orphans
    the kernel re-parented to it as a subreaper. ``keep``: children that another part waits for."""
    me, kept = os.getpid(), set(keep)
    for pid, (ppid, state) in _table().items():
        if ppid == me and state == "Z" and pid not in kept:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


class Reaper:
    """Collects, as they come (SIGCHLD), the exits of orphans this process adopted as their
    subreaper, so none stays a zombie while a long job runs (a rank that runs ``cmd &`` through a
    shell every step would otherwise fill the pid table). ``own()``: the children that another part
    of the process waits for, which it never touches."""

    def __init__(self, own: Callable[[], Iterable[int]]) -> None:
        self._own = own
        self._held = 0
        self._pending = False
        self._previous: Any = None

    def __enter__(self) -> Reaper:
        self._previous = signal.signal(signal.SIGCHLD, self._on_child)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGCHLD, self._previous)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Hold the reaping while children are started and recorded in ``own()``: one that died
        at once would otherwise be taken for an orphan, and its exit code lost."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if self._pending and not self._held:
                self._pending = False
                reap_adopted(self._own())

    def _on_child(self, signum: int, frame: Any) -> None:
        if self._held:
            self._pending = True
        else:
            reap_adopted(self._own())
