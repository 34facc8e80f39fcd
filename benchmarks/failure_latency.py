"""Failure latency of one job across nodes: from a failure on node 1 to the launchers' exit.

Each trial starts two launchers on loopback (``--world_size 2N --node_rank 0|1 --master_addr
127.0.0.1``, N ranks each), waits until every rank has finished a step (marker files), then fails
the job one of two ways:

* rank: the last rank (on node 1) calls ``os._exit(7)`` once the benchmark drops a marker file,
  taking ``time.time()`` just before. Both launchers must exit 7 and name that rank.
* node: the benchmark SIGKILLs node 1's launcher, taking ``time.time()`` just before. Node 0's
  launcher must exit 1, saying that node 1's launcher stopped answering.

Each runs under two jobs: ``allreduce``, a plain script whose ranks all-reduce one float every
20 ms over gloo, and ``trainer``, the lockstep Trainer fitting ``throughput_job.py``'s MLP (32 wide).
The time of each launcher's exit is taken by a thread blocked in ``wait()`` on it. The table gives,
per scenario, the median and maximum over trials of the time until the last launcher to watch
had exited (both for a rank failure, node 0 for a lost node), against the 5 s target:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/failure_latency.py --trials 5

Options: ``--nproc 1`` (ranks per node, default 2), ``--jobs allreduce``, ``--failures rank``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

TARGET_S = 5.0
EXIT_CODE = 7
LOST_NODE_CODE = 1
STEP_SLEEP_S = 0.02
WIDTH = 32
START_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 60.0
JOBS = ("allreduce", "trainer")
FAILURES = {"rank": "rank exits", "node": "node 1's launcher SIGKILLed"}


# -- the job: this file, run by the launcher with --rank-job -----------------------------------

def after_step(here: Path, rank: int, world_size: int, step: int) -> None:
    """Mark this rank as training after its first step; the last rank dies once told to."""
    if step == 1:
        (here / f"training{rank}").touch()
    if rank == world_size - 1 and (here / "die").exists():
        die(here)


def die(here: Path) -> NoReturn:
    at = time.time()
    (here / "died").write_text(repr(at))
    os._exit(EXIT_CODE)


def run_allreduce(here: Path) -> None:
    import torch
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    rank, world_size = tdist.get_rank(), tdist.get_world_size()
    x = torch.zeros(1)
    step = 0
    while True:
        tdist.all_reduce(x)
        step += 1
        after_step(here, rank, world_size, step)
        time.sleep(STEP_SLEEP_S)


def run_trainer(here: Path) -> None:
    import torch
    from torch.utils.data import TensorDataset

    import lockstep
    from lockstep import dist
    from throughput_job import CLASSES, MLP, make_loader

    class Markers(lockstep.Callback):
        def batch_end(self, state: Any, logger: Any) -> None:
            after_step(here, dist.get_global_rank(), dist.get_world_size(), int(state.timestamp.batch))

    torch.set_num_threads(1)
    dist.initialize_dist("cpu")
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1024, WIDTH, generator=gen), torch.randint(0, CLASSES, (1024,), generator=gen))
    torch.manual_seed(0)
    model = MLP(WIDTH)
    # far more batches than a trial lasts: only the failure ends it
    trainer = lockstep.Trainer(model=model, train_dataloader=make_loader(data), max_duration="10000000ba",
                               optimizers=torch.optim.AdamW(model.parameters()), progress_bar=False,
                               callbacks=[Markers()])
    trainer.fit()


# -- the benchmark --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trial:
    latencies: tuple[float, ...]  # per launcher watched, seconds from the failure to its exit
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(job: str, here: Path, nproc: int) -> list[subprocess.Popen[bytes]]:
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "lockstep", "-n", str(nproc), "--world_size", str(2 * nproc),
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
               "--run_directory", str(here / f"run{node}"), str(Path(__file__).resolve()),
               "--rank-job", job, "--here", str(here)]
        with open(here / f"node{node}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, cwd=here, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def watch_exits(procs: list[subprocess.Popen[bytes]]) -> tuple[dict[int, float], list[threading.Thread]]:
    """Threads that note ``time.time()`` as each launcher exits (a poll loop would add its period)."""
    exits: dict[int, float] = {}

    def wait(node: int) -> None:
        procs[node].wait()
        exits[node] = time.time()

    threads = [threading.Thread(target=wait, args=(node,), daemon=True) for node in range(len(procs))]
    for t in threads:
        t.start()
    return exits, threads


def wait_training(here: Path, world_size: int, exits: dict[int, float]) -> str | None:
    markers = [here / f"training{rank}" for rank in range(world_size)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(m.exists() for m in markers):
        if exits:
            return f"node(s) {sorted(exits)} exited before every rank trained"
        if time.monotonic() > deadline:
            return f"not every rank trained within {START_TIMEOUT_S:g} s"
        time.sleep(0.05)
    return None


def log_tail(here: Path, node: int) -> str:
    return (here / f"node{node}.log").read_text(errors="replace")[-600:]


def check_rank_failure(procs: list[subprocess.Popen[bytes]], here: Path, world_size: int) -> str | None:
    codes = [p.returncode for p in procs]
    if codes != [EXIT_CODE, EXIT_CODE]:
        return f"exit codes {codes}, not [{EXIT_CODE}, {EXIT_CODE}]: {log_tail(here, 0)}"
    for node in (0, 1):
        log = (here / f"node{node}.log").read_text(errors="replace")
        if f"the job failed: rank {world_size - 1} on " not in log or \
                f"failed first with exit code {EXIT_CODE}" not in log:
            return f"node {node} did not name rank {world_size - 1}: {log_tail(here, node)}"
    return None


def check_lost_node(procs: list[subprocess.Popen[bytes]], here: Path) -> str | None:
    if procs[0].returncode != LOST_NODE_CODE:
        return f"node 0 exited {procs[0].returncode}, not {LOST_NODE_CODE}: {log_tail(here, 0)}"
    if "node 1's launcher stopped answering" not in (here / "node0.log").read_text(errors="replace"):
        return f"node 0 did not report the lost node: {log_tail(here, 0)}"
    return None


def fail_and_time(failure: str, procs: list[subprocess.Popen[bytes]], here: Path, world_size: int,
                  exits: dict[int, float], threads: list[threading.Thread]) -> Trial:
    watched = (0, 1) if failure == "rank" else (0,)
    if failure == "rank":
        (here / "die").touch()
    else:
        died = time.time()
        os.kill(procs[1].pid, signal.SIGKILL)
    for node in watched:
        threads[node].join(EXIT_TIMEOUT_S)
    if any(node not in exits for node in watched):
        return Trial((), f"a launcher was still running {EXIT_TIMEOUT_S:g} s after the failure")
    if failure == "rank":
        if not (here / "died").exists():
            return Trial((), f"rank {world_size - 1} never died: {log_tail(here, 1)}")
        died = float((here / "died").read_text())
    latencies = tuple(exits[node] - died for node in watched)
    error = check_rank_failure(procs, here, world_size) if failure == "rank" else check_lost_node(procs, here)
    return Trial(latencies, error)


def run_trial(job: str, failure: str, nproc: int, root: Path) -> Trial:
    here = Path(tempfile.mkdtemp(dir=root))
    procs = start_nodes(job, here, nproc)
    exits, threads = watch_exits(procs)
    try:
        error = wait_training(here, 2 * nproc, exits)
        if error is not None:
            return Trial((), f"{error}: {log_tail(here, 0)}")
        return fail_and_time(failure, procs, here, 2 * nproc, exits, threads)
    finally:
        for proc in procs:  # a launcher's watchdog takes its ranks with it
            if proc.returncode is None:
                proc.kill()
        for t in threads:
            t.join()


def summary_row(name: str, trials: list[Trial]) -> str:
    good = [t for t in trials if t.error is None]
    if not good:
        return f"| {name} | 0 of {len(trials)} | - | - | - | - | no trial ran cleanly |"
    last = [max(t.latencies) for t in good]
    per_node = [statistics.median(t.latencies[node] for t in good) for node in range(len(good[0].latencies))]
    nodes = [f"{x:.2f}" for x in per_node] + ["-"] * (2 - len(per_node))
    verdict = "meets" if max(last) <= TARGET_S else "MISSES"
    return (f"| {name} | {len(good)} of {len(trials)} | {statistics.median(last):.2f} | {max(last):.2f} | "
            f"{nodes[0]} | {nodes[1]} | {verdict} <= {TARGET_S:g} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="per scenario")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per node")
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument("--failures", nargs="+", choices=sorted(FAILURES), default=list(FAILURES))
    parser.add_argument("--rank-job", choices=JOBS, help=argparse.SUPPRESS)
    parser.add_argument("--here", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job is not None:
        (run_allreduce if args.rank_job == "allreduce" else run_trainer)(args.here)
        return
    results: dict[str, list[Trial]] = {}
    with tempfile.TemporaryDirectory(prefix="failure-latency-") as root:
        for trial in range(args.trials):  # scenarios interleaved, so all see the same machine load
            for job in args.jobs:
                for failure in args.failures:
                    name = f"{job}, {FAILURES[failure]}"
                    result = run_trial(job, failure, args.nproc, Path(root))
                    results.setdefault(name, []).append(result)
                    shown = " ".join(f"{x:.2f}" for x in result.latencies)
                    print(f"{name} #{trial}: " + (f"FAIL {result.error}" if result.error else f"{shown} s"),
                          flush=True)
    print(f"\n2 nodes x {args.nproc} ranks on loopback, {os.cpu_count()} cpus; seconds from the failure "
          f"to the last watched launcher's exit\n")
    print("| scenario | clean trials | median s | max s | node 0 median | node 1 median | target |")
    print("|---|---|---|---|---|---|---|")
    for name, trials in results.items():
        print(summary_row(name, trials))
    sys.exit(1 if any(t.error for trials in results.values() for t in trials) else 0)


if __name__ == "__main__":
    main()
