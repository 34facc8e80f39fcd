"""A save folder is owned (issue 37): a second live job of a run in the same folder is refused at
Trainer(...), so is another live run whose checkpoint names would overwrite the first's, and the
claim dies with its holder, so a killed job never blocks its own autoresume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lockstep import Trainer
from lockstep.checkpoint import ownership, payload
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]

# Another process: claims FOLDER for RUN with PATTERNS (comma-separated), says so, then waits.
_HOLDER = """
import sys, time
from pathlib import Path
from lockstep.checkpoint import ownership, payload
error = ownership.claim(Path(sys.argv[1]), sys.argv[2], 0, sys.argv[3].split(","))
print(error or "claimed", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder():
    """Start a process holding a claim; every one started is killed at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(folder: Path, run: str, patterns: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), run, patterns], text=True,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def trainer(folder: Path, run_name: str, **kwargs) -> Trainer:
    model = MLP()
    kwargs.setdefault("max_duration", "2ba")
    return Trainer(model=model, train_dataloader=loader(4), run_name=run_name,
                   optimizers=torch.optim.SGD(model.parameters(), lr=0.1), progress_bar=False, device="cpu",
                   save_folder=str(folder), save_interval="1ba", **kwargs)


DEFAULT = "ep*-ba*-rank0.pt,latest-rank0.pt"  # the names the default templates give rank 0


def test_a_second_live_job_of_the_run_is_refused_in_one_line(tmp_path: Path, holder) -> None:
    holder(tmp_path, "run-a", DEFAULT)
    message = error_of(trainer, tmp_path, "run-a", autoresume=True)
    assert message.startswith(f"run 'run-a' is already running with save_folder {tmp_path} (pid "), message
    assert "stop that job first, or give this one another run_name or save_folder" in message
    assert "\n" not in message and not list(tmp_path.glob("*.pt"))


def test_another_live_run_writing_the_same_names_is_refused(tmp_path: Path, holder) -> None:
    holder(tmp_path, "run-a", DEFAULT)
    message = error_of(trainer, tmp_path, "run-b", save_overwrite=True)
    assert message.startswith(f"save_folder {tmp_path} is in use by run 'run-a' (pid "), message
    assert "put {run_name} in save_filename and save_latest_filename" in message
    assert not list(tmp_path.glob("*.pt"))


def test_runs_whose_names_differ_share_a_folder(tmp_path: Path, holder) -> None:
    holder(tmp_path, "run-a", "run-a-ep*-ba*.pt,run-a-latest.pt")
    t = trainer(tmp_path, "run-b", save_filename="{run_name}-ep{epoch}-ba{batch}.pt",
                save_latest_filename="{run_name}-latest.pt")
    t.fit()
    t.close()
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["run-b-ep0-ba1.pt", "run-b-ep0-ba2.pt", "run-b-latest.pt"]


def test_the_claim_dies_with_its_holder_and_the_end_of_fit_gives_it_up(tmp_path: Path, holder) -> None:
    proc = holder(tmp_path, "run-a", DEFAULT)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    began = time.monotonic()
    t = trainer(tmp_path, "run-a", autoresume=True)  # its own autoresume, right away
    assert time.monotonic() - began < 5
    # this process holds it from Trainer(...) on; another process cannot take it until fit ends
    probe = [sys.executable, "-c", "import sys; from pathlib import Path; from lockstep.checkpoint import ownership; "
             f"print(ownership.claim(Path(sys.argv[1]), 'run-a', 0, {DEFAULT.split(',')!r}))", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    held = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=60).stdout
    assert "is already running" in held, held
    t.fit()
    assert not list(tmp_path.glob(".lockstep-claim.*"))
    assert subprocess.run(probe, capture_output=True, text=True, env=env, timeout=60).stdout.strip() == "None"
    t.close()


def test_a_claim_of_this_process_never_refuses_another_trainer_of_it(tmp_path: Path) -> None:
    first = trainer(tmp_path, "run-a")
    first.fit()  # still open, as in a notebook where the next cell builds another Trainer
    second = trainer(tmp_path, "run-a", autoresume=True, max_duration="3ba")
    second.fit()
    assert second.state.timestamp.batch.value == 3
    first.close()
    second.close()


_TWO_RUNS = """
import sys, torch
from lockstep import Trainer, dist
from tests.trainer.common import MLP, loader
model = MLP()
Trainer(model=model, train_dataloader=loader(2, n=80), max_duration="20ba", run_name=sys.argv[2],
        optimizers=torch.optim.SGD(model.parameters(), lr=float(sys.argv[3])), progress_bar=False,
        device="cpu", save_folder=sys.argv[1], save_interval="1ba").fit()
print("finished", flush=True)
"""


def test_two_runs_started_together_in_one_folder_never_mix_their_checkpoints(tmp_path: Path) -> None:
    script = tmp_path / "two_runs.py"
    script.write_text(_TWO_RUNS)
    folder = tmp_path / "shared"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    jobs = [subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", "--run_directory", str(tmp_path / run),
                              str(script), str(folder), run, lr], cwd=tmp_path, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for run, lr in (("run-a", "0.1"), ("run-b", "0.5"))]
    results = [job.communicate(timeout=100) for job in jobs]
    codes = [job.returncode for job in jobs]
    assert sorted(codes) == [0, 1], results  # one ran, the other was refused before training
    loser = codes.index(1)
    # refused as a live run's folder, or (when the other one had finished first on a busy machine)
    # as a folder that holds another run's checkpoints
    err = results[loser][1]
    assert "is in use by run" in err or "already holds checkpoints" in err, err[-3000:]
    assert "finished" not in results[loser][0]
    winner = ("run-a", "run-b")[1 - loser]
    saved = sorted(folder.glob("*.pt"))
    assert len(saved) == 21  # 20 checkpoints and the latest pointer
    for path in saved:
        content = torch.load(path, weights_only=False)
        assert payload.metadata(content, path) is not None and content["state"]["run_name"] == winner, path
