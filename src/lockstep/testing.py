"""Helpers for testing distributed code with real processes on one machine.

``run_distributed(fn, world_size=2)`` starts ``world_size`` processes, gives each the launcher's
environment contract and a process group (rendezvous through a FileStore in a fresh temporary
directory, so no TCP port can be raced), runs ``fn`` on every rank and returns the results ordered by
rank. A rank's exception is re-raised in the caller with its rank number and full traceback.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from lockstep.launcher.prefork import DEFAULT_PRELOAD
from lockstep.launcher.supervisor import describe_exit

__all__ = ["run_distributed"]

# After one rank fails, the others get this long to report before they are killed: peers blocked in a
# collective with the failed rank would otherwise wait for the full timeout.
_FAILURE_GRACE_S = 5.0
_EXIT_GRACE_S = 10.0
# What every rank would import: what the launcher's prefork server preloads, the Trainer, and
# torchmetrics (~3 s of CPU) with the first model that has metrics, and DeepSpeed where it is safe to
# (lockstep.parallel.deepspeed_preload). One that is not installed is skipped.
_PRELOAD = [*DEFAULT_PRELOAD, "lockstep.trainer", "torchmetrics", "lockstep.parallel.deepspeed_preload"]


def _rank_env(rank: int, world_size: int, local_world_size: int, extra: Mapping[str, str]) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(rank // local_world_size),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _context() -> Any:
    """Ranks are forked from a server process that has imported torch and lockstep once: a rank
    then starts in a few milliseconds instead of the seconds a fresh interpreter needs to import
    them, and still forks from a clean process (never from the caller, whose threads and state a
    fork would copy)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts, on first use
    return context


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    timeout: float,
    environ: dict[str, str],
    call: bytes,
    conn: multiprocessing.connection.Connection,
) -> None:
    # The server's environment is the caller's when it started; this rank's is the caller's now,
    # set before ``fn``'s module is imported (by unpickling it) so that its imports see it too.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    _one_compile_thread()
    try:
        fn, args = pickle.loads(call)
        store = torch_dist.FileStore(store_path, world_size)
        torch_dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(*args)
        # Plain pickle, not multiprocessing's: that one sends tensors as shared memory, which
        # vanishes when this process exits before the parent has rebuilt them.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        conn.close()
    # Interpreter shutdown with torch loaded takes ~0.6 s; the result is delivered and the group torn
    # down, so skip it. (This also skips atexit handlers registered by fn.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _one_compile_thread() -> None:
    """torch.compile's kernels compiled in the rank's own process, one thread as torch's own, unless
    the rank's ``TORCHINDUCTOR_COMPILE_THREADS`` says otherwise: inductor would start a pool of
    worker processes in every rank. Inductor read its setting when the server imported torch, from
    the server's environment, so it is set here from the rank's."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = int(os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") or 1)


def _kill(process: multiprocessing.process.BaseProcess) -> None:
    if process.is_alive():
        process.kill()
    process.join()


def _describe_exit(exitcode: int | None) -> str:
    return "is still running" if exitcode is None else f"ended with {describe_exit(exitcode)}"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    timeout: float = 120.0,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    local_world_size: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new processes and return their results ordered by rank.

    ``fn``, ``args`` and the results must be picklable, so ``fn`` is a module-level function. Inside
    ``fn`` the process group is initialized and ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
    NODE_RANK`` are set; ``env`` adds variables to every rank's environment. ``local_world_size``
    makes the ranks look like nodes of that many ranks each (all on this machine). Raises RuntimeError with
    the rank and traceback if a rank raises or dies, and TimeoutError naming the ranks still running
    after ``timeout`` seconds. No rank outlives the call.
    """
    local_world_size = _checked_local_world_size(world_size, local_world_size)
    context = _context()
    call = pickle.dumps((fn, tuple(args)))  # an unpicklable fn or argument fails here, in the caller
    processes: list[multiprocessing.process.BaseProcess] = []
    readers: list[multiprocessing.connection.Connection] = []
    with tempfile.TemporaryDirectory(prefix="lockstep-run-distributed-") as tmp:
        store_path = os.path.join(tmp, "store")
        try:
            for rank in range(world_size):
                reader, writer = context.Pipe(duplex=False)
                readers.append(reader)
                environ = {**os.environ, **_rank_env(rank, world_size, local_world_size, env or {})}
                worker_args = (rank, world_size, store_path, backend, timeout, environ, call, writer)
                process = context.Process(target=_worker, args=worker_args, name=f"lockstep-rank-{rank}")
                process.start()
                processes.append(process)
                writer.close()  # the parent's copy: the reader then sees EOF if the child dies
            reports = _collect(processes, readers, timeout)
        finally:
            for process in processes:
                _kill(process)
            for reader in readers:
                reader.close()
    return reports


def _checked_local_world_size(world_size: int, local_world_size: int | None) -> int:
    if world_size < 1:
        raise ValueError(f"run_distributed(world_size={world_size}): world_size must be >= 1.")
    local_world_size = local_world_size or world_size
    if world_size % local_world_size:
        raise ValueError(f"run_distributed: world_size {world_size} is not a multiple of "
                         f"local_world_size {local_world_size}.")
    return local_world_size


def _collect(
    processes: list[multiprocessing.process.BaseProcess],
    readers: list[multiprocessing.connection.Connection],
    timeout: float,
) -> list[Any]:
    """Wait for every rank's report and exit; raise for the first rank that failed."""
    deadline = time.monotonic() + timeout
    reports: dict[int, tuple[str, Any]] = {}
    failures: list[tuple[int, str]] = []  # in the order they were seen
    pending = set(range(len(processes)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables: dict[Any, int] = {}
        for rank in pending:
            waitables[readers[rank]] = rank
            waitables[processes[rank].sentinel] = rank
        for ready in multiprocessing.connection.wait(list(waitables), timeout=remaining):
            rank = waitables[ready]
            if rank not in pending:
                continue
            pending.discard(rank)
            report = _receive(readers[rank], processes[rank])
            reports[rank] = report
            kind, payload = report
            if kind == "error":
                failures.append((rank, f"raised an exception:\n{payload}"))
            elif kind != "ok":
                failures.append((rank, payload))
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    if failures:
        raise RuntimeError(_failure_message(failures, sorted(pending), len(processes)))
    if pending:
        raise TimeoutError(
            f"run_distributed: rank(s) {sorted(pending)} of {len(processes)} did not finish within "
            f"{timeout:g} s and were killed (a hang, e.g. a collective that not every rank reached?)."
        )
    _await_exits(processes, deadline)
    return [reports[rank][1] for rank in range(len(processes))]


def _receive(
    reader: multiprocessing.connection.Connection, process: multiprocessing.process.BaseProcess
) -> tuple[str, Any]:
    """Read one rank's report, or describe how it died without one."""
    try:
        if reader.poll():
            return pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        pass
    except pickle.UnpicklingError as e:
        return ("died", f"sent a result that could not be unpickled: {e}")
    process.join(timeout=_EXIT_GRACE_S)
    return ("died", f"exited without reporting a result: it {_describe_exit(process.exitcode)}")


def _await_exits(processes: list[multiprocessing.process.BaseProcess], deadline: float) -> None:
    for rank, process in enumerate(processes):
        process.join(timeout=max(deadline - time.monotonic(), _EXIT_GRACE_S))
        if process.is_alive():
            raise TimeoutError(f"run_distributed: rank {rank} returned its result but did not exit.")
        if process.exitcode != 0:
            # e.g. SIGABRT at interpreter shutdown: the result arrived, but the process did not exit
            # cleanly, which a launcher would report as a failed run.
            raise RuntimeError(
                f"run_distributed: rank {rank} returned its result but then "
                f"{_describe_exit(process.exitcode)}."
            )


def _failure_message(failures: list[tuple[int, str]], unfinished: list[int], world_size: int) -> str:
    first_rank, first_text = failures[0]
    lines = [f"run_distributed: rank {first_rank} of {world_size} failed: {first_text}"]
    for rank, text in failures[1:]:
        lines.append(f"rank {rank} also failed: {text}")
    if unfinished:
        lines.append(f"rank(s) {unfinished} had not finished and were killed.")
    return "\n".join(lines)
