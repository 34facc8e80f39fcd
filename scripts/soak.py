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

Every trial counts its kills from what the launcher saw, not from the plan: a rank's SIGKILL
when the launcher reports a rank that "failed first with signal SIGKILL" (under kill-2nodes, both
nodes must report the same number), sigterm-all's SIGTERM when the launcher exits 143, and
kill-launcher's SIGKILL when the launcher's own exit status says SIGKILL. A kill is survived when
its trial passes. A trial in which no kill landed is reported as "no kill", never as a pass.

Prints one line per trial (its verdict, kills that landed of those planned, kills survived), then
per attack and in total: trials, passes, failures, trials without a kill, kills, kills survived;
then the reason of each trial that did not pass. Exit status 0 only if every trial passed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "checkpoint" / "train_job.py"
BATCHES = 24
JOB_FLAGS: list[str] = []
"""Flags every launch of the job gets (``--sharded``)."""
# the launcher's report on the rank that failed first: one line per failed attempt
SIGKILLED = re.compile(r"^lockstep: .*failed first with signal SIGKILL$", re.MULTILINE)


@dataclass(frozen=True)
class Outcome:
    """One trial: ``kills`` that landed (see the module docstring), ``planned`` by the attack,
    ``error`` the reason it failed (None: its checks passed)."""

    kills: int
    planned: int
    error: str | None = None

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "fail"
        return "pass" if self.kills > 0 else "no kill"

    @property
    def survived(self) -> int:
        return self.kills if self.verdict == "pass" else 0

    def line(self) -> str:
        counts = f"kills {self.kills} of {self.planned} planned, survived {self.survived}"
        if self.verdict == "pass":
            return f"pass  {counts}"
        if self.verdict == "no kill":
            return f"NO KILL  {counts}: not counted as a pass"
        return f"FAIL  {counts}: {self.error}"


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


def sigkills(log: str) -> int:
    return len(SIGKILLED.findall(log))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: torch.equal compares values (0.0 equals -0.0, a NaN equals nothing)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def same(a: Path, b: dict[str, torch.Tensor]) -> bool:
    if not a.exists():
        return False
    got = torch.load(a, weights_only=True)
    return got.keys() == b.keys() and all(bitwise_equal(got[k], b[k]) for k in b)


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


def kill_in_save(tmp: Path, rng: random.Random, reference: dict) -> Outcome:
    batch = rng.choice(range(4, BATCHES, 4))
    code, log = finish(launch(tmp, "job", "--kill-in-save", f"0:{batch}", restarts=1))
    kills = sigkills(log)
    if code != 0:
        return Outcome(kills, 1, f"exit {code}: {log[-300:]}")
    if any(p.name.startswith(".") for p in (tmp / "job").iterdir()):
        return Outcome(kills, 1, "a temporary file was left")
    return Outcome(kills, 1, None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run")


def kill_in_write(tmp: Path, rng: random.Random, reference: dict) -> Outcome:
    batch = rng.choice(range(4, BATCHES, 4))
    rank = rng.randint(0, 1) if JOB_FLAGS else 0
    code, log = finish(launch(tmp, "job", "--kill-in-write", f"0:{rank}:{batch}", restarts=1))
    kills = sigkills(log)
    if code != 0:
        return Outcome(kills, 1, f"exit {code}: {log[-300:]}")
    if any(p.name.startswith(".") for p in (tmp / "job").iterdir()):
        return Outcome(kills, 1, "a temporary file was left")
    return Outcome(kills, 1, None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run")


def kill_ranks(tmp: Path, rng: random.Random, reference: dict) -> Outcome:
    steps = sorted(rng.sample(range(1, BATCHES), rng.randint(1, 3)))
    kills = [arg for attempt, step in enumerate(steps) for arg in ("--kill", f"{attempt}:{rng.randint(0, 1)}:{step}")]
    code, log = finish(launch(tmp, "job", *kills, restarts=3))
    landed = sigkills(log)
    if code != 0:
        return Outcome(landed, len(steps), f"exit {code}: {log[-300:]}")
    return Outcome(landed, len(steps),
                   None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run")


def kill_2nodes(tmp: Path, rng: random.Random, reference: dict) -> Outcome:
    steps = sorted(rng.sample(range(1, BATCHES), rng.randint(1, 3)))
    kills = [arg for attempt, step in enumerate(steps) for arg in ("--kill", f"{attempt}:{rng.randint(0, 1)}:{step}")]
    results = [finish(p) for p in launch_nodes(tmp, "job", *kills, restarts=3)]
    landed = [sigkills(log) for _, log in results]
    if any(code != 0 for code, _ in results):
        return Outcome(landed[0], len(steps),
                       "exits " + ", ".join(str(c) for c, _ in results) + ": " + results[0][1][-300:])
    if landed[0] != landed[1]:
        return Outcome(landed[0], len(steps), f"the nodes report different kills: {landed[0]} and {landed[1]}")
    return Outcome(landed[0], len(steps),
                   None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run")


def sigterm_all(tmp: Path, rng: random.Random, reference: dict) -> Outcome:
    progress = tmp / "progress"
    proc = launch(tmp, "job", "--save-interval", "100ba", "--sleep", "0.05", "--workers", "1",
                  "--progress", str(progress))
    at = rng.randint(2, BATCHES - 4)
    deadline = time.monotonic() + 120
    while not (progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= at):
        if proc.poll() is not None or time.monotonic() > deadline:
            return Outcome(0, 1, "the job did not get going")
        time.sleep(0.01)
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    code, log = finish(proc)
    if code != 128 + signal.SIGTERM:
        return Outcome(0, 1, f"exit {code} instead of 143: {log[-300:]}")
    if len(list((tmp / "job").glob("ep*.pt"))) != 1:
        return Outcome(1, 1, "no preemption checkpoint")
    code, log = finish(launch(tmp, "job", "--save-interval", "100ba"))
    if code != 0:
        return Outcome(1, 1, f"resume: exit {code}: {log[-300:]}")
    return Outcome(1, 1, None if same(tmp / "job.pt", reference) else "weights differ from the uninterrupted run")


def kill_launcher(tmp: Path, rng: random.Random, reference: dict) -> Outcome:
    proc = launch(tmp, "job", "--sleep", "0.02")
    time.sleep(rng.choice([0.0, 0.05, 0.2, rng.uniform(0.3, 4.0)]))
    pids = descendants(proc.pid)
    proc.kill()
    proc.communicate()
    # a launcher that had already finished was not killed: its status is its own exit code
    kills = int(proc.returncode == -signal.SIGKILL)
    time.sleep(0.5)
    pids = set(pids) | set(descendants(proc.pid))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return Outcome(kills, 1, f"processes left behind: {left}" if left else None)


ATTACKS = {"kill-in-save": kill_in_save, "kill-ranks": kill_ranks, "sigterm-all": sigterm_all,
           "kill-launcher": kill_launcher, "kill-2nodes": kill_2nodes,
           "kill-in-write": kill_in_write}


def tally(counts: Counter[tuple[str, str]], attacks: list[str], what: str) -> int:
    return sum(counts[(attack, what)] for attack in attacks)


def print_summary(counts: Counter[tuple[str, str]], attacks: list[str], trials: int) -> None:
    for name, group in [*((attack, [attack]) for attack in attacks), ("total", attacks)]:
        print(f"{name:14s} trials {trials * len(group):4d}  passed {tally(counts, group, 'pass'):4d}  "
              f"failed {tally(counts, group, 'fail'):4d}  no kill {tally(counts, group, 'no kill'):4d}  "
              f"kills {tally(counts, group, 'kills'):4d}  survived {tally(counts, group, 'survived'):4d}")
    print(f"\nkills survived {tally(counts, attacks, 'survived')} of {tally(counts, attacks, 'kills')}, "
          f"trials passed {tally(counts, attacks, 'pass')} of {trials * len(attacks)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attacks", nargs="+", choices=sorted(ATTACKS))
    parser.add_argument("--trials", type=int, default=20, help="per attack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded", action="store_true", help="FSDP with sharded checkpoints")
    parser.add_argument("--zero", type=int, choices=(1, 2, 3), help="DeepSpeed ZeRO at this stage")
    parser.add_argument("--direct", action="store_true",
                        help="every tensor of this small model written with O_DIRECT, as large ones are")
    args = parser.parse_args()
    if args.direct:
        JOB_FLAGS.append("--direct")
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
                    outcome = ATTACKS[attack](Path(tmp), rng, reference)
                counts.update({(attack, outcome.verdict): 1, (attack, "kills"): outcome.kills,
                               (attack, "survived"): outcome.survived})
                if outcome.verdict != "pass":
                    failures.append(f"{attack} #{trial}: {outcome.line()}")
                print(f"{attack} #{trial}: {outcome.line()}", flush=True)
    print()
    print_summary(counts, args.attacks, args.trials)
    for line in failures:
        print(line)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
