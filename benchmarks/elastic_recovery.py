"""A rank killed at a random moment: what it costs an elastic job (``--min_ranks``) and a job that
restarts every rank from its newest checkpoint (``--max_restarts 1``, a save every 2 batches).

    .venv/bin/python benchmarks/elastic_recovery.py --trials 20
    .venv/bin/python benchmarks/elastic_recovery.py --trials 20 --nodes
    .venv/bin/python benchmarks/elastic_recovery.py --trials 20 --fsdp [sharded]
    .venv/bin/python benchmarks/elastic_recovery.py --trials 20 --zero 2

With ``--nodes``, two launchers on this machine are two nodes of 2 ranks, and node 1's launcher is
SIGKILLed (its ranks die with it): the elastic job (``--nnodes 1:2``) goes on with node 0's ranks;
the restarting one (``--nnodes 2 --max_restarts 1``) gets a new node 1 launcher at once, as if a
scheduler replaced the node without delay. With ``--fsdp`` both train under FSDP and save every 2
batches (full checkpoints, or DCP's with ``--fsdp sharded``): the elastic job goes on from its
last checkpoint, resharded over the ranks left; so with
``--zero STAGE``, under DeepSpeed.

Each trial draws a rank of 4 and a moment (0 to 0.6 s after the first batch ended; under FSDP
or DeepSpeed, after the first checkpoint was published), and runs both jobs (tests/elastic/elastic_job.py, 0.1 s
of sleep after each batch so that the moment falls anywhere in a step), SIGKILLing that rank at
that moment in each. From the batch-end times every rank records it reports, per job, the seconds
from the kill to the first finish of the next batch (past the newest any rank had finished; under
restarts, the first batch finished after the kill), and the batches trained again (under restarts
the newest batch finished before the kill, less the one the job went on from; in the elastic job
what its change records say). A second rank lost after the kill fails the trial. It prints each
trial and the medians; every run must end with exit code 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "elastic" / "elastic_job.py"
JOBS = {"elastic": ["--min_ranks", "3"], "restart": ["--max_restarts", "1"]}
NODE_JOBS = {"elastic": ["--nnodes", "1:2"], "restart": ["--nnodes", "2", "--max_restarts", "1"]}


def ends_of(log: Path) -> list[tuple[int, float]]:
    """(batch, wall-clock time) of each batch end one rank recorded."""
    return [(int(b), float(t)) for b, t in (line.split() for line in log.read_text().splitlines())]


def ends(out: Path) -> list[tuple[int, float]]:
    """Every rank's batch ends."""
    return [end for log in out.glob("ends*") for end in ends_of(log)]


def await_file(path: Path, procs: list[subprocess.Popen[str]]) -> None:
    """Until ``path`` (a file or a symlink) exists; every launcher in ``procs`` must stay up meanwhile."""
    while not (path.is_symlink() or path.exists()):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("".join(p.communicate()[1] for p in procs))
        time.sleep(0.01)


def _start(kind: str, out: Path, launcher: list[str], run: str = "run",
           extra: list[str] | None = None) -> subprocess.Popen[str]:
    extra = extra or []
    extra = [*extra, *(["--save", str(out / "saves")] if kind == "restart" or _sharded(extra) else [])]
    # with a training metric, which each change gathers anew, imported once by the prefork server
    preload = os.environ.get("LOCKSTEP_PREFORK", "1")
    preload = "+torchmetrics" if preload == "1" else preload + ",torchmetrics" if preload.startswith("+") else preload
    return subprocess.Popen([sys.executable, "-m", "lockstep", *launcher, "--run_directory", str(out / run),
                             str(JOB), str(out), "--sleep", "0.1", "--train-accuracy", *extra], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "LOCKSTEP_PREFORK": preload},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _sharded(extra: list[str]) -> bool:
    """Whether the job trains with sharded state (FSDP, DeepSpeed): its elastic run saves, and goes on
    from its last checkpoint."""
    return "--fsdp" in extra or "--zero" in extra


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trained_again(out: Path) -> int:
    """The finished steps an elastic job trained again, as its ranks' change records say."""
    return max((json.loads(line)["trained_again"] for log in out.glob("changes*")
                for line in log.read_text().splitlines()), default=0)


def trial(kind: str, rank: int | None, delay: float, tmp: Path, extra: list[str]) -> tuple[float, int]:
    """One job of ``kind``; ``rank`` is SIGKILLed, or (None) node 1's launcher of two nodes of 2 ranks,
    which under restarts a new launcher replaces at once."""
    out = tmp / kind
    out.mkdir()
    if rank is None:
        port = str(_free_port())
        node = ["--nproc-per-node", "2", "--master_addr", "127.0.0.1", "--master_port", port, "--rdzv_timeout", "60",
                *NODE_JOBS[kind]]
        procs = [_start(kind, out, [*node, "--node_rank", str(n)], f"run{n}", extra) for n in (0, 1)]
    else:
        procs = [_start(kind, out, ["-n", "4", *JOBS[kind]], extra=extra)]
    # with sharded state the elastic job goes on from a checkpoint: from the first one on
    await_file(out / "saves" / "latest-rank0.pt" if _sharded(extra) else out / "ends0", procs)
    time.sleep(delay)
    killed = time.time()
    if rank is None:
        procs[1].kill()
        procs[1].communicate()
        procs[1] = _start(kind, out, [*node, "--node_rank", "1"], "run1-again", extra) if kind == "restart" \
            else procs[0]
    else:
        os.kill(int((out / f"pid{rank}").read_text()), signal.SIGKILL)
    err = ""
    for proc in dict.fromkeys(procs):
        err += proc.communicate(timeout=300)[1]
        if proc.returncode != 0:
            raise RuntimeError(err)
    if "SIGABRT" in err or err.count(" left (") > 1:
        raise RuntimeError(f"a rank was lost after the kill:\n{err}")
    recorded = ends(out)
    before = max(b for b, t in recorded if t < killed)  # the newest batch any rank had finished
    if kind == "restart":  # the first batch finished after the kill, and its first finish
        batch = min(b for b, t in recorded if t > killed)
        return min(t for b, t in recorded if b == batch and t > killed) - killed, before - (batch - 1)
    # the first finish of the next batch after those trained again (from a checkpoint: under
    # FSDP), or finished late by a rank
    since = max((t for b, t in recorded if b <= before and t > killed), default=killed)
    return min(t for b, t in recorded if b == before + 1 and t > since) - killed, trained_again(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--nodes", action="store_true", help="kill node 1's launcher of two nodes of 2 ranks")
    parser.add_argument("--fsdp", nargs="?", const="full", default=None,
                        help="train under FSDP, saving checkpoints of this state_dict_type (full) every 2 batches")
    parser.add_argument("--zero", type=int, default=None, help="train under DeepSpeed at this ZeRO stage, saving "
                                                                 "every 2 batches")
    args = parser.parse_args()
    extra = ["--fsdp", args.fsdp] if args.fsdp else ["--zero", str(args.zero)] if args.zero is not None else []
    results: dict[str, list[tuple[float, int]]] = {kind: [] for kind in JOBS}
    for n in range(args.trials):
        rank, delay = None if args.nodes else random.randrange(4), random.uniform(0.0, 0.6)
        with tempfile.TemporaryDirectory() as tmp:
            row = {kind: trial(kind, rank, delay, Path(tmp), extra) for kind in JOBS}
        for kind, value in row.items():
            results[kind].append(value)
        print(f"trial {n + 1}: {'node 1' if rank is None else f'rank {rank}'} at {delay:.2f} s: " + ", ".join(
            f"{kind} {s:.2f} s to the next step, {lost} batch(es) again" for kind, (s, lost) in row.items()),
            flush=True)
    for kind, values in results.items():
        print(f"{kind}: median {statistics.median(v[0] for v in values):.2f} s from the kill to the next finished "
              f"step (max {max(v[0] for v in values):.2f}), median {statistics.median(v[1] for v in values)} "
              f"batch(es) trained again (max {max(v[1] for v in values)})")


if __name__ == "__main__":
    main()
