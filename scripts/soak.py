"""Fault soak, outside CI: many random attacks on real 2-rank jobs, counted.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/soak.py --trials 100 kill-in-save
    OMP_NUM_THREADS=1 .venv/bin/python scripts/soak.py --trials 50 kill-ranks sigterm-all kill-launcher
    OMP_NUM_THREADS=1 .venv/bin/python scripts/soak.py --sharded --trials 100 kill-in-write kill-in-save
    OMP_NUM_THREADS=1 .venv/bin/python scripts/soak.py --zero 2 --trials 20 kill-in-write kill-ranks

Each trial runs ``tests/checkpoint/train_job.py`` (24 batches, autoresume, a checkpoint every 4)
under ``lockstep -n 2`` and attacks it; with ``--sharded`` the job trains under FSDP, with ``--zero
N`` under DeepSpeed ZeRO stage N, and every rank writes its part of each checkpoint in the background:

kill-in-save   rank 0 SIGKILLs itself while a background write of a random checkpoint is in
               flight (after the file is written, before it is published); ``--max_restarts 1``.
               Pass: the job ends bitwise equal to an uninterrupted one, no temporary file left.
kill-in-write  a random rank SIGKILLs itself as its writer thread starts on a random checkpoint
               (under ``--sharded`` or ``--zero`` any rank writes; otherwise only rank 0 does),
               while the other rank trains on; ``--max_restarts 1``. Pass: bitwise equal, no
               temporary file left.
kill-ranks     a random rank SIGKILLs itself after a random batch, up to 3 times; ``--max_restarts
               3``. Pass: bitwise equal.
sigterm-all    SIGTERM to every process of the job at once (launcher, ranks, their DataLoader
               worker) at a random moment, as a scheduler's preemption does. Pass: exit 143, one
               checkpoint, and a resumed run bitwise equal.
kill-launcher  SIGKILL of the launcher at a random moment (also right after it starts ranks).
               Pass: no process of the job is left after 10 s.
kill-2nodes    the same job as two nodes (two launchers of one rank each, on loopback); a random
               rank SIGKILLs itself after a random batch, up to 3 times; ``--max_restarts 3`` on
               both. Pass: both launchers exit 0 and the job ends bitwise equal.

Prints one line per trial and the counts: trials, passes, failures (with the reason of each).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "checkpoint" / "train_job.py"
BATCHES = 24
JOB_FLAGS: list[str] = []
"""Flags every launch of the job gets (``--sharded``)."""


def launch(folder: Path, name: str, *extra: str, restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lockstep", "-n", "2", "--max_restarts", str(restarts), str(JOB),
           "--folder", str(folder / name), "--out", str(folder / f"{name}.pt"), *JOB_FLAGS, *extra]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def launch_nodes(folder: Path, name: str, *extra: str, restarts: int = 0) -> list[subprocess.Popen]:
    """The job as two nodes of one rank each: the same world of 2 as :func:`launch`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [subprocess.Popen(
        [sys.executable, "-m", "lockstep", "-n", "1", "--world_size", "2", "--node_rank", str(node),
         "--master_addr", "127.0.0.1", "--master_port", port, "--max_restarts", str(restarts),
         "--run_directory", str(folder / f"run{node}"), str(JOB), "--folder", str(folder / name),
         "--out", str(folder / f"{name}.pt"), *JOB_FLAGS, *extra],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for node in (0, 1)]


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def same(a: Path, b: dict[str, torch.Tensor]) -> bool:
    if not a.exists():
        return False
    got = torch.load(a, weights_only=True)
    return got.keys() == b.keys() and all(torch.equal(got[k], b[k]) for k in b)


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                todo += children
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_in_save(tmp: Path, rng: random.Random, reference: dict) -> str | None:
    batch = rng.choice(range(4, BATCHES, 4))
    code, log = finish(launch(tmp, "job", "--kill-in-save", f"0:{batch}", restarts=1))
    if code != 0:
        return f"exit {code}: {log[-300:]}"
    if any(p.name.startswith(".") for p in (tmp / "job").iterdir()):
        return "a temporary file was left"
    return None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run"


def kill_in_write(tmp: Path, rng: random.Random, reference: dict) -> str | None:
    batch = rng.choice(range(4, BATCHES, 4))
    rank = rng.randint(0, 1) if JOB_FLAGS else 0
    code, log = finish(launch(tmp, "job", "--kill-in-write", f"0:{rank}:{batch}", restarts=1))
    if code != 0:
        return f"exit {code}: {log[-300:]}"
    if "failed first with signal SIGKILL" not in log:
        return "no rank was killed"
    if any(p.name.startswith(".") for p in (tmp / "job").iterdir()):
        return "a temporary file was left"
    return None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run"


def kill_ranks(tmp: Path, rng: random.Random, reference: dict) -> str | None:
    steps = sorted(rng.sample(range(1, BATCHES), rng.randint(1, 3)))
    kills = [arg for attempt, step in enumerate(steps) for arg in ("--kill", f"{attempt}:{rng.randint(0, 1)}:{step}")]
    code, log = finish(launch(tmp, "job", *kills, restarts=3))
    if code != 0:
        return f"exit {code}: {log[-300:]}"
    return None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run"


def kill_2nodes(tmp: Path, rng: random.Random, reference: dict) -> str | None:
    steps = sorted(rng.sample(range(1, BATCHES), rng.randint(1, 3)))
    kills = [arg for attempt, step in enumerate(steps) for arg in ("--kill", f"{attempt}:{rng.randint(0, 1)}:{step}")]
    results = [finish(p) for p in launch_nodes(tmp, "job", *kills, restarts=3)]
    if any(code != 0 for code, _ in results):
        return "exits " + ", ".join(str(c) for c, _ in results) + ": " + results[0][1][-300:]
    return None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run"


def sigterm_all(tmp: Path, rng: random.Random, reference: dict) -> str | None:
    progress = tmp / "progress"
    proc = launch(tmp, "job", "--save-interval", "100ba", "--sleep", "0.05", "--workers", "1",
                  "--progress", str(progress))
    at = rng.randint(2, BATCHES - 4)
    deadline = time.monotonic() + 120
    while not (progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= at):
        if proc.poll() is not None or time.monotonic() > deadline:
            return "the job did not get going"
        time.sleep(0.01)
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    code, log = finish(proc)
    if code != 128 + signal.SIGTERM:
        return f"exit {code} instead of 143: {log[-300:]}"
    if len(list((tmp / "job").glob("ep*.pt"))) != 1:
        return "no preemption checkpoint"
    code, log = finish(launch(tmp, "job", "--save-interval", "100ba"))
    if code != 0:
        return f"resume: exit {code}: {log[-300:]}"
    return None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run"


def kill_launcher(tmp: Path, rng: random.Random, reference: dict) -> str | None:
    proc = launch(tmp, "job", "--sleep", "0.02")
    time.sleep(rng.choice([0.0, 0.05, 0.2, rng.uniform(0.3, 4.0)]))
    pids = descendants(proc.pid)
    proc.kill()
    proc.communicate()
    time.sleep(0.5)
    pids = set(pids) | set(descendants(proc.pid))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return f"processes left behind: {left}" if left else None


ATTACKS = {"kill-in-save": kill_in_save, "kill-ranks": kill_ranks, "sigterm-all": sigterm_all,
           "kill-launcher": kill_launcher, "kill-2nodes": kill_2nodes,
           "kill-in-write": kill_in_write}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attacks", nargs="+", choices=sorted(ATTACKS))
    parser.add_argument("--trials", type=int, default=20, help="per attack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded", action="store_true", help="FSDP with sharded checkpoints")
    parser.add_argument("--zero", type=int, choices=(1, 2, 3), help="DeepSpeed ZeRO at this stage")
    args = parser.parse_args()
    if args.sharded:
        JOB_FLAGS.append("--sharded")
    if args.zero is not None:
        JOB_FLAGS.extend(["--zero", str(args.zero)])
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="soak-") as root:
        code, log = finish(launch(Path(root), "reference"))
        if code != 0:
            sys.exit(f"the uninterrupted reference run failed: {log[-2000:]}")
        reference = torch.load(Path(root) / "reference.pt", weights_only=True)
        counts: Counter[tuple[str, str]] = Counter()
        failures: list[str] = []
        for attack in args.attacks:
            for trial in range(args.trials):
                with tempfile.TemporaryDirectory(dir=root) as tmp:
                    error = ATTACKS[attack](Path(tmp), rng, reference)
                counts[(attack, "fail" if error else "pass")] += 1
                if error:
                    failures.append(f"{attack} #{trial}: {error}")
                print(f"{attack} #{trial}: {'FAIL ' + error if error else 'pass'}", flush=True)
    print()
    for attack in args.attacks:
        print(f"{attack:14s} trials {args.trials:4d}  passed {counts[(attack, 'pass')]:4d}  "
              f"failed {counts[(attack, 'fail')]:4d}")
    for line in failures:
        print(line)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
