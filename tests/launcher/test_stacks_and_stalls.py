"""SIGQUIT prints every rank's stacks; --stall_timeout ends a stalled job with a diagnosis; SIGUSR1/2
reach the ranks without stopping the job; SIGHUP stops it as torchrun does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.launcher.stacks import Stacks
from lockstep.launcher.job import STOPPED, WAITING
from lockstep.launcher.stall import STALL_EXIT_CODE, diagnose, stall_failures
from lockstep.progress import Phase, Progress
from tests.launcher.conftest import launch, wait_for_files

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]

# Rank 1 stops in the loop given by HOW (sleeping, or holding the GIL in C code), at step 3, until
# the file `release` exists; rank 0 waits for it in an all_reduce meanwhile.
_STALLING = """
import os, re, signal, sys, time
from pathlib import Path
import torch, torch.distributed as td
import lockstep.dist as ld
td.init_process_group("gloo")
rank = td.get_rank()
here = Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *a: print(f"rank {rank} got SIGUSR1", flush=True))
x = torch.ones(1)
for step in range(6):
    if rank == 1 and step == 3:
        (here / "stopped").write_text("1")
        while not (here / "release").exists():
            if os.environ["HOW"] == "gil":
                re.match(r"(a+)+$", "a" * 22 + "b")  # backtracks in C, holding the GIL
            else:
                time.sleep(0.05)
    td.all_reduce(x)
    ld.heartbeat(step + 1)
    time.sleep(0.05)
while os.environ.get("LINGER") and not (here / "finish").exists():
    time.sleep(0.05)
print(f"rank {rank} done", flush=True)
"""


def _start(args: list[str], cwd: Path, env: dict[str, str], stdout=subprocess.PIPE,
           stderr=subprocess.PIPE) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lockstep", *args], cwd=cwd, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=stdout, stderr=stderr)


def _sections(console: str) -> dict[int, str]:
    """Each rank's printed stacks, by rank."""
    out: dict[int, str] = {}
    current = None
    for line in console.splitlines():
        if line.startswith("rank ") and "(pid " in line:
            current = int(line.split()[1])
            out[current] = ""
        elif current is not None and line.startswith("  "):
            out[current] += line + "\n"
        else:
            current = None
    return out


@pytest.mark.parametrize("how", ["sleep", "gil"])
def test_sigquit_prints_every_ranks_stack_and_the_job_goes_on(tmp_path: Path, write_script, how: str) -> None:
    script = write_script("stall.py", _STALLING)
    where = f"stall.py\", line {16 if how == 'gil' else 18}"
    console = tmp_path / "console.err"
    with open(console, "w") as err_file:
        proc = _start(["-n", "2", str(script), str(tmp_path)], tmp_path, {"HOW": how}, stderr=err_file)
    wait_for_files([tmp_path / "stopped"])
    time.sleep(0.5)  # rank 0 is in its all_reduce by now
    proc.send_signal(signal.SIGQUIT)
    deadline = time.monotonic() + 20  # rank 1 is released once the stacks it is asserted in are printed
    while time.monotonic() < deadline:
        stacks = _sections(console.read_text())
        if set(stacks) == {0, 1} and "in all_reduce" in stacks[0] and where in stacks[1]:
            break
        time.sleep(0.1)
    (tmp_path / "release").write_text("1")
    out, _ = proc.communicate(timeout=60)
    err = console.read_text()
    assert proc.returncode == 0, err
    assert "rank 0 done" in out  # the job went on to its end
    stacks = _sections(err)
    assert set(stacks) == {0, 1}, err
    assert "in all_reduce" in stacks[0]
    assert where in stacks[1], stacks[1]


def test_stall_prints_stacks_names_the_rank_that_stopped_and_exits_124(tmp_path: Path, write_script) -> None:
    script = write_script("stall.py", _STALLING)
    began = time.monotonic()
    result = launch(["-n", "2", "--stall_timeout", "2", str(script), str(tmp_path)], tmp_path,
                    env={"HOW": "sleep"}, timeout=60)
    assert result.returncode == STALL_EXIT_CODE, result.stderr
    assert time.monotonic() - began < 30
    err = result.stderr
    assert "made no progress for 2 s (--stall_timeout)" in err
    assert set(_sections(err)) == {0, 1}
    assert "rank 1 (pid" in err and "stopped first; last completed step 3" in err, err
    assert "rank 0 (pid" in err and "waiting in a collective; last completed step 3" in err
    assert "look at rank 1 first" in err


def test_stall_timeout_from_the_environment(tmp_path: Path, write_script) -> None:
    script = write_script("stall.py", _STALLING)
    result = launch(["-n", "2", str(script), str(tmp_path)], tmp_path,
                    env={"HOW": "sleep", "LOCKSTEP_STALL_TIMEOUT": "2"}, timeout=60)
    assert result.returncode == STALL_EXIT_CODE, result.stderr


# A healthy Trainer run with a 1.5 s stall timeout: a 3 s first step (before any report), an
# evaluation of 3 s in all (in 0.3 s batches) and 3 s checkpoint writes on rank 0: one in its
# writer thread that the next save waits for, then the last one, while rank 1 waits.
_HEALTHY_TRAINER = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from lockstep import Trainer, dist
from lockstep.callbacks import Callback
from tests.trainer.common import MLP, dataset, loader

class SlowEval(Dataset):
    def __init__(self):
        self.data = dataset(80)
    def __len__(self):
        return len(self.data)
    def __getitem__(self, i):
        time.sleep(0.1)
        return self.data[i]

class SlowFirstStep(Callback):
    def batch_start(self, state, logger):
        if state.timestamp.batch == 0:
            time.sleep(4)

from lockstep.checkpoint import files
write_temp = files.write_temp
def slow_write(*args, **kwargs):  # each of rank 0's writes: in the writer thread, or at the end
    time.sleep(4)
    return write_temp(*args, **kwargs)
files.write_temp = slow_write

evaluation = SlowEval()
model = MLP()
trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="6ba",
                  optimizers=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                  eval_dataloader=DataLoader(evaluation, batch_size=4, sampler=dist.get_sampler(evaluation)),
                  eval_interval="3ba", save_folder=sys.argv[1], save_interval="4ba",
                  callbacks=[SlowFirstStep()])
trainer.fit()
print("finished", flush=True)
"""


def test_a_healthy_trainer_run_never_trips_the_stall_timeout(tmp_path: Path, write_script) -> None:
    # each slow part (the first step, a save, an evaluation: 4 s) outlasts the stall timeout, and
    # each piece of it (an eval batch: 0.4 s) leaves room for a busy machine
    script = write_script("healthy.py", _HEALTHY_TRAINER)
    result = launch(["-n", "2", "--stall_timeout", "2.5", str(script), str(tmp_path / "ckpt")], REPO,
                    env={"PYTHONPATH": str(REPO)}, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished" in result.stdout and "stall" not in result.stderr


def test_sigusr_reaches_every_rank_and_the_job_goes_on_sighup_stops_it(tmp_path: Path, write_script) -> None:
    script = write_script("stall.py", _STALLING)
    console = tmp_path / "console.txt"
    with open(console, "w") as out:
        proc = _start(["-n", "2", "--tee", "3", str(script), str(tmp_path)], tmp_path,
                      {"HOW": "sleep", "LINGER": "1"}, stdout=out)
    wait_for_files([tmp_path / "stopped"])
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGUSR2)  # no handler in the script: the bootstrap's keeps it alive
    # A Python handler runs once the main thread is back in the interpreter: rank 0 is in a
    # collective until rank 1 goes on.
    (tmp_path / "release").write_text("1")
    deadline = time.monotonic() + 30
    while console.read_text().count("got SIGUSR1") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    shown = console.read_text()
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert "[default0]:rank 0 got SIGUSR1" in shown and "[default1]:rank 1 got SIGUSR1" in shown, shown
    assert "received SIGUSR2, passing it to every rank; the job goes on" in err
    assert "received SIGHUP, forwarding it to every rank" in err
    assert "done" not in shown


def _dump(rank: int, innermost: str) -> Stacks:
    text = f"Current thread 0x00000000000000{rank:02x} (most recent call first):\n  {innermost}\n"
    return Stacks(rank, 100 + rank, text, main_ident=f"0x00000000000000{rank:02x}")


def test_diagnosis_when_every_rank_is_in_a_collective_names_the_ones_behind() -> None:
    collective = 'File "/x/torch/distributed/distributed_c10d.py", line 1 in all_reduce'
    dumps = [_dump(0, collective), _dump(1, collective), _dump(2, collective)]
    progress = {0: Progress(9, 9, 0.0, Phase.RUNNING), 1: Progress(8, 8, 0.0, Phase.RUNNING),
                2: Progress(9, 9, 0.0, Phase.RUNNING)}
    d = diagnose(dumps, progress, now=10.0)
    assert d.stopped == [1] and d.waiting == [0, 2]
    same = diagnose(dumps, {r: Progress(9, 9, 0.0, Phase.RUNNING) for r in range(3)}, now=10.0)
    assert same.stopped == [] and "every rank is waiting in the same collective" in same.lines[-1]


def test_a_node_records_the_ranks_it_found_stopped_else_a_waiting_one_as_a_lesser_cause() -> None:
    collective = 'File "/x/torch/distributed/distributed_c10d.py", line 1 in all_reduce'
    dumps = [_dump(2, collective), _dump(3, 'File "/x/job.py", line 7 in <module>')]
    progress = {r: Progress(3, 3, 0.0, Phase.RUNNING) for r in (2, 3)}
    [stopped] = stall_failures(diagnose(dumps, progress, now=10.0), dumps, progress, 1, "h", suspects=[2, 3])
    assert (stopped.node, stopped.rank, stopped.pid, stopped.cause) == (1, 3, 103, STOPPED)
    assert stopped.code == STALL_EXIT_CODE
    assert stopped.tail[-1].strip() == 'File "/x/job.py", line 7 in <module>'
    waiting = dumps[:1]
    [other] = stall_failures(diagnose(waiting, progress, now=10.0), waiting, progress, 0, "h", suspects=[])
    assert (other.rank, other.cause) == (2, WAITING)
