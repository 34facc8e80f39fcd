"""Faults end to end under the launcher: kill -9 of ranks with --max_restarts, kill -9 during a
save, and SIGTERM preemption; each resumed job must end with the uninterrupted job's parameters."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_bitwise, shared_run
from tests.launcher.conftest import launch

JOB = Path(__file__).with_name("train_job.py")
REPO = Path(__file__).resolve().parents[2]


def job(tmp: Path, name: str, *extra: str, restarts: int = 0, timeout: float = 120,
        ranks: int = 2) -> subprocess.CompletedProcess:
    return launch(["-n", str(ranks), "--max_restarts", str(restarts), str(JOB), "--folder", str(tmp / name),
                   "--out", str(tmp / f"{name}.pt"), *extra], cwd=REPO, timeout=timeout)


def final(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """The uninterrupted job's parameters under DDP and under FSDP with sharded checkpoints (one
    launch, which trains each in turn)."""
    def make(tmp: Path) -> dict[str, dict[str, torch.Tensor]]:
        tmp.mkdir()
        result = job(tmp, "clean", "--layouts", "ddp,sharded")
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("attempt 0 resumed at batch 0") == 2, result.stdout
        return {layout: torch.load(tmp / f"clean.pt.{layout}", weights_only=True) for layout in ("ddp", "sharded")}
    return shared_run(tmp_path_factory, "faults-reference", make)


@pytest.mark.timeout(240)
def test_ranks_killed_at_random_steps_restart_and_match(reference, tmp_path: Path) -> None:
    expected = reference["ddp"]
    rng = random.Random(1234)
    # three kills of alternating ranks, each later than the last checkpoint before it
    steps = sorted(rng.sample(range(2, 23), 3))
    kills = [f"{attempt}:{attempt % 2}:{step}" for attempt, step in enumerate(steps)]
    extra = [arg for k in kills for arg in ("--kill", k)]
    result = job(tmp_path, "killed", *extra, restarts=3, timeout=200)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("restarting this node's ranks") == 3, result.stderr
    assert "failed first with signal SIGKILL" in result.stderr
    assert_bitwise(final(tmp_path, "killed"), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("direct", [False, True], ids=["page_cache", "o_direct"])
def test_kill_9_in_the_middle_of_a_save_loses_nothing(reference, tmp_path: Path, direct: bool) -> None:
    expected = reference["ddp"]
    result = job(tmp_path, "torn", "--kill-in-save", "0:12", *(["--direct"] if direct else []), restarts=1)
    assert result.returncode == 0, result.stderr
    # the torn save left the batch-8 checkpoint as the latest, and the job went on from there
    assert "attempt 1 resumed at batch 8" in result.stdout, result.stdout
    assert_bitwise(final(tmp_path, "torn"), expected)
    leftovers = [p.name for p in (tmp_path / "torn").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # the next save removed the dead writer's temporary file


@pytest.mark.timeout(240)
def test_kill_9_of_either_rank_during_background_sharded_writes_loses_nothing(reference, tmp_path: Path) -> None:
    # FSDP sharded checkpoints, written by every rank's thread while training goes on: rank 1 dies
    # as it starts on ba12's shards (attempt 0), rank 0 after ba16's are written but before they
    # are published (attempt 1); each time the checkpoint before stays the latest
    result = job(tmp_path, "torn", "--sharded", "--kill-in-write", "0:1:12", "--kill-in-save", "1:16", restarts=2)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("restarting this node's ranks") == 2, result.stderr
    assert "attempt 2 resumed at batch 12" in result.stdout, result.stdout
    assert_bitwise(final(tmp_path, "torn"), reference["sharded"])
    leftovers = [p.name for p in (tmp_path / "torn").iterdir() if p.name.startswith(".")]
    assert leftovers == []


FOLDER_LAYOUTS = ("sharded", "local", "zero2")


def four_rank_kills(seed: int) -> list[str]:
    """One kill -9 per folder layout, each on its own attempt: a random rank after a random batch
    (``--kill ATTEMPT:RANK:BATCH:LAYOUT``, the layouts trained in turn, 16 batches each)."""
    rng = random.Random(seed)
    return [f"{attempt}:{rng.randrange(4)}:{rng.randrange(2, 16)}:{layout}"
            for attempt, layout in enumerate(FOLDER_LAYOUTS)]


@pytest.mark.timeout(360)
def test_four_ranks_killed_in_each_folder_layout_restart_and_match(tmp_path: Path) -> None:
    # FSDP sharded and local and ZeRO-2, where every rank writes its part of each checkpoint in the
    # background: a rank killed at any step on 4 ranks restarts all of them from what was published
    layouts = ["--layouts", ",".join(FOLDER_LAYOUTS), "--batches", "16"]
    clean = job(tmp_path, "clean", *layouts, ranks=4, timeout=200)
    assert clean.returncode == 0, clean.stderr
    kills = four_rank_kills(seed=49)
    result = job(tmp_path, "killed", *layouts, *(a for k in kills for a in ("--kill", k)), restarts=3,
                 ranks=4, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("failed first with signal SIGKILL") == 3, result.stderr
    for layout in FOLDER_LAYOUTS:
        assert_bitwise(torch.load(tmp_path / f"killed.pt.{layout}", weights_only=True),
                       torch.load(tmp_path / f"clean.pt.{layout}", weights_only=True))


def batches_done(progress: Path) -> int:
    """The count the job's rank 0 last wrote to ``progress`` (0 before it has, or while it rewrites
    the file: read once, since a second read may find it truncated)."""
    text = progress.read_text() if progress.exists() else ""
    return int(text) if text.strip().isdigit() else 0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("everyone", [False, True], ids=["launcher", "every-process-with-workers"])
def test_sigterm_preempts_saves_and_autoresume_matches(reference, tmp_path: Path, everyone: bool) -> None:
    # everyone: a scheduler's preemption signals every process of the job at once, DataLoader
    # workers included; they must not take their rank down before its checkpoint is written
    expected = reference["ddp"]
    progress = tmp_path / "progress"
    cmd = [sys.executable, "-m", "lockstep", "-n", "2", str(JOB), "--folder", str(tmp_path / "pre"),
           "--out", str(tmp_path / "pre.pt"), "--save-interval", "100ba", "--sleep", "0.05",
           "--progress", str(progress), *(["--workers", "1"] if everyone else [])]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not batches_done(progress) >= 5:
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not get going"
        time.sleep(0.02)
    targets = [proc.pid, *descendants(proc.pid)] if everyone else [proc.pid]
    if everyone:
        assert len(targets) >= 5  # the launcher, its watchdog, two ranks and their workers
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after batch" in err, err
    saved = sorted(p.name for p in (tmp_path / "pre").glob("ep*.pt"))
    assert len(saved) == 1 and not (tmp_path / "pre.pt").exists(), (saved, err)
    stopped_at = int(saved[0].split("-ba")[1].split("-")[0])
    assert 5 <= stopped_at < 24
    result = job(tmp_path, "pre", "--save-interval", "100ba")
    assert result.returncode == 0, result.stderr
    assert f"attempt 0 resumed at batch {stopped_at}" in result.stdout
    assert_bitwise(final(tmp_path, "pre"), expected)
