"""A bucket's writes (uploads, small objects, deletions) done in order by a child process, so that
they share neither the interpreter lock nor the CPU priority of the process that asks for them.

A training rank that uploads on threads of its own holds its interpreter lock for every chunk the
client reads, signs and sends; its training thread then waits for the lock on every torch call. A
child process has a lock of its own, and runs (every thread of it) under ``SCHED_IDLE`` where Linux
allows, taking only CPU that training leaves idle. This is how Composer's ``RemoteUploaderDownloader``
uploads too (``use_procs``).

The child is ``python -m lockstep.objectstore.writer``; it reads one JSON job per line on its
standard input and answers one JSON line per job on a pipe of its own. Jobs run one after the
other, each action tried up to ``num_attempts`` times with growing pauses. Once a job fails for
good the later ones are not run (a later job, such as a latest pointer, may name what the failed
one lost); each is answered as skipped. A job may carry a guard, a lease and its holder's id
(:mod:`lockstep.objectstore.lease`): before each of its actions the child reads the lease, and
once another holder's record is there (a job that took the folder over) the job fails without
writing. The child dies with the process that started it (Linux's
parent-death signal), and ends when told to (:meth:`StoreWriter.close`) or when its input closes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import lockstep

Action = tuple[str, ...]
"""``("upload", key, path)``; ``("upload_new", key, path)``, which fails if the object exists;
``("put", key, text)``; or ``("delete_tree", key)``: the object and every object under
``key + "/"``."""


Guard = tuple[str, str]
"""``(key, holder)``: a lease's key and the id of the holder whose job may write."""


class TakenOver(RuntimeError):
    """A guarded job's lease is held by another holder: not retried."""


@dataclass
class Outcome:
    """What became of a job."""

    error: str | None = None
    """Why it failed (None: it was done)."""
    skipped: bool = False
    """Not run: an earlier job had failed."""
    timings: list[tuple[int, float]] = field(default_factory=list)
    """(bytes, seconds) of each file the job uploaded."""


class StoreWriter:
    """A child process doing ``bucket``'s writes, in the order they are submitted.

    ``scheme`` names the store's class (:data:`lockstep.objectstore.uri.BACKENDS`) and
    ``store_options`` are its further keyword arguments (``prefix``, endpoint, credentials, ...:
    a store's :meth:`~lockstep.objectstore.store.BucketStore.options`): they reach the child on
    its input, not its command line, which other users of the machine can read. With
    ``stop_at_failure=False`` a failed job does not stop the later ones (files that do not depend
    on each other, such as a logger's)."""

    def __init__(self, bucket: str, *, scheme: str = "s3", store_options: dict[str, Any] | None = None,
                 num_attempts: int = 3, backoff_s: float = 0.5, stop_at_failure: bool = True,
                 idle: bool = True) -> None:
        if num_attempts < 1:
            raise ValueError(f"num_attempts must be >= 1, got {num_attempts}")
        self.bucket = bucket
        settings = {"scheme": scheme, "bucket": bucket, "store": store_options or {},
                    "num_attempts": num_attempts, "backoff_s": backoff_s, "stop_at_failure": stop_at_failure}
        read, write = os.pipe()
        env = dict(os.environ)
        # the child imports lockstep from where this process did, whatever sys.path held then
        source = str(Path(lockstep.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "lockstep.objectstore.writer", str(write), str(os.getpid()),
                 "1" if idle else "0"],
                stdin=subprocess.PIPE, text=True, env=env, pass_fds=(write,))
        finally:
            os.close(write)
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(settings) + "\n")
        self._process.stdin.flush()
        self._answers = os.fdopen(read, "r")
        self._lock = threading.Condition()
        self._sent = 0
        self._outcomes: dict[int, Outcome] = {}
        self._callbacks: dict[int, Callable[[Outcome], None]] = {}
        self._ended: str | None = None
        """Why the child is gone before it was closed (None: it runs, or was closed)."""
        self._closing = False
        # The reading thread holds this object only weakly, and its input is ended when it is
        # collected: a writer nobody closed (a logger dropped without close()) still ends its child
        # once its jobs are done, instead of leaving it for the whole life of this process.
        self._reader = threading.Thread(target=_read_answers, args=(weakref.ref(self), self._answers, self._process),
                                        name="lockstep-store-writer", daemon=True)
        self._reader.start()
        weakref.finalize(self, _end_input, self._process.stdin)

    def submit(self, actions: list[Action], *, cleanup: str | None = None, guard: Guard | None = None,
               then: Callable[[Outcome], None] | None = None) -> int:
        """Queue a job of ``actions``, done in order; ``cleanup`` (a file or folder) is removed by the
        child once the job ends, done or not. With a ``guard``, each action waits for a read of its
        lease and the job fails, unwritten, if another holder's record is there. ``then`` is called
        with the job's outcome (on the thread that reads the child's answers). Returns the job's number."""
        line = json.dumps({"actions": actions, "cleanup": cleanup, "guard": guard}) + "\n"
        with self._lock:
            self._sent += 1
            job = self._sent
            if then is not None:
                self._callbacks[job] = then
            if self._ended is not None or self._closing:
                self._settle(job, Outcome(error=self._ended or f"the upload process for bucket {self.bucket!r} "
                                                               f"was closed"))
                return job
            try:
                assert self._process.stdin is not None
                self._process.stdin.write(line)
                self._process.stdin.flush()
            except OSError:
                pass  # the child is gone: the thread that reads its answers settles this job with why
        return job

    def wait(self, job: int | None = None, timeout: float | None = None) -> bool:
        """Wait until job ``job`` (default: every job submitted so far) has an outcome."""
        with self._lock:
            last = self._sent if job is None else job
            return self._lock.wait_for(lambda: all(j in self._outcomes for j in range(1, last + 1)), timeout)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    def outcome(self, job: int) -> Outcome | None:
        with self._lock:
            return self._outcomes.get(job)

    def close(self) -> None:
        """Let the child finish the jobs it was given, then end it."""
        with self._lock:
            self._closing = True
            _end_input(self._process.stdin)
        self._process.wait()
        self._reader.join()

    def _ended_with(self, job: int, code: int) -> None:
        """The child exited with ``code`` after answering ``job`` jobs: settle the rest with why."""
        with self._lock:
            if not self._closing or code != 0:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                self._ended = f"the upload process for bucket {self.bucket!r} {how}"
            for pending in range(job + 1, self._sent + 1):
                if pending not in self._outcomes:
                    self._settle(pending, Outcome(error=self._ended or f"the upload process for bucket "
                                                                       f"{self.bucket!r} ended before this job"))

    def _settle(self, job: int, outcome: Outcome) -> None:
        """Record ``job``'s outcome (the lock held) and call its callback."""
        self._outcomes[job] = outcome
        then = self._callbacks.pop(job, None)
        if then is not None:
            then(outcome)
        self._lock.notify_all()


def _end_input(stdin: TextIO | None) -> None:
    """Tell the child to end once its jobs are done. Said, not left to the end of its input: a
    forked data loader worker may hold the pipe open."""
    if stdin is not None and not stdin.closed:
        try:
            stdin.write(json.dumps({"end": True}) + "\n")
            stdin.close()
        except (OSError, ValueError):
            pass


def _read_answers(ref: weakref.ref[StoreWriter], answers: TextIO, process: subprocess.Popen[str]) -> None:
    """The thread that reads the child's answers and settles each job of the writer ``ref`` names;
    once that writer is gone, answers are read and dropped (the child must not block on a full pipe)."""
    job = 0
    for line in answers:
        job += 1
        writer = ref()
        if writer is None:
            continue
        answer = json.loads(line)
        outcome = Outcome(answer.get("error"), answer.get("skipped", False),
                          [(int(b), float(s)) for b, s in answer.get("timings", [])])
        with writer._lock:
            writer._settle(job, outcome)
        del writer  # not held while the next answer is awaited
    code = process.wait()
    writer = ref()
    if writer is not None:
        writer._ended_with(job, code)


def _run(store: Any, action: Action, timings: list[tuple[int, float]]) -> None:
    kind, key = action[0], action[1]
    if kind == "upload_new":  # as an upload, unless the object exists
        try:
            store.get_object_size(key)
        except FileNotFoundError:
            kind = "upload"
        else:
            raise FileExistsError(f"{store.get_uri(key)} already exists and overwrite=False")
    if kind == "upload":
        started = time.perf_counter()
        store.upload_object(key, action[2])
        timings.append((os.path.getsize(action[2]), time.perf_counter() - started))
    elif kind == "put":
        store.upload_bytes(key, action[2].encode())
    elif kind == "delete_tree":
        for each in [key] + store.list_objects(key + "/"):
            store.delete_object(each)
    else:
        raise ValueError(f"unknown action {kind!r}")


def _describe(store: Any, action: Action) -> str:
    kind, key = action[0], action[1]
    what = {"upload": f"upload {Path(action[-1]).name} to", "upload_new": f"upload {Path(action[-1]).name} to",
            "put": "write", "delete_tree": "delete"}[kind]
    return f"{what} {store.get_uri(key)}"


def _check(store: Any, guard: Guard, action: Action) -> None:
    """Raise :class:`TakenOver` when the lease ``guard`` names holds another holder's record. No
    lease at all lets the write through: its holder released it, and no other job has one."""
    key, holder = guard
    try:
        record = json.loads(store.read_bytes(key) or b"{}")
    except FileNotFoundError:
        return
    except ValueError:
        record = {}
    if not isinstance(record, dict):
        record = {}
    if record.get("holder") != holder:
        who = f"pid {record.get('pid', '?')} on {record.get('host', '?')}"
        raise TakenOver(f"did not {_describe(store, action)}: another job ({who}) holds {store.get_uri(key)} now, "
                        f"so this job no longer writes there")


def _attempt(store: Any, action: Action, num_attempts: int, backoff_s: float,
             timings: list[tuple[int, float]], guard: Guard | None = None) -> None:
    for attempt in range(num_attempts):
        try:
            if guard is not None:
                _check(store, guard, action)
            _run(store, action, timings)
            return
        except (FileExistsError, TakenOver):
            raise  # no attempt would change that
        except Exception as e:
            if attempt + 1 == num_attempts:
                detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise RuntimeError(f"could not {_describe(store, action)} after {num_attempts} attempts: "
                                   f"{type(e).__name__}: {detail}") from e
            time.sleep(backoff_s * 2 ** attempt)


def _die_with_parent(parent: int) -> None:
    """Be killed when ``parent`` dies (Linux), or end now if it already has."""
    if sys.platform == "linux":
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        sys.exit(0)


def _serve(store: Any, jobs: TextIO, answers: TextIO, num_attempts: int, backoff_s: float,
           stop_at_failure: bool) -> None:
    failed = False
    for line in jobs:
        job = json.loads(line)
        if job.get("end"):
            return
        answer: dict[str, Any] = {}
        timings: list[tuple[int, float]] = []
        try:
            if failed:
                answer["skipped"] = True
                continue
            guard = None if job.get("guard") is None else tuple(job["guard"])
            for action in job["actions"]:
                _attempt(store, tuple(action), num_attempts, backoff_s, timings, guard)
        except Exception as e:
            failed = stop_at_failure
            answer["error"] = str(e)
        finally:
            cleanup = job.get("cleanup")
            if cleanup and os.path.isdir(cleanup):
                shutil.rmtree(cleanup, ignore_errors=True)
            elif cleanup:
                Path(cleanup).unlink(missing_ok=True)
            answer["timings"] = timings
            answers.write(json.dumps(answer) + "\n")
            answers.flush()


def main(argv: list[str]) -> None:
    fd, parent, idle_only = argv
    _die_with_parent(int(parent))
    if idle_only == "1":
        from lockstep import idle

        idle.yield_to_training()  # before any thread starts: the client's transfer threads inherit it
        idle.out_of_a_ranks_session(int(parent))
    answers = os.fdopen(int(fd), "w")
    # the client's own prints must not reach the answers, nor the job's output as if the rank's
    os.dup2(2, 1)
    settings = json.loads(sys.stdin.readline())
    from lockstep.objectstore.uri import store_of

    store = store_of(settings["scheme"], settings["bucket"], **settings["store"])
    _serve(store, sys.stdin, answers, settings["num_attempts"], settings["backoff_s"], settings["stop_at_failure"])


if __name__ == "__main__":
    main(sys.argv[1:])
