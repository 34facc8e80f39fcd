"""What the elastic tests share: the job under the launcher, its end, and the comparison with the
uninterrupted 4-rank run (the ``reference`` fixture, in conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import launcher_env
from tests.trainer.common import assert_same_params

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("elastic_job.py")
Reference = tuple[dict[str, torch.Tensor], dict[int, list[int]]]


def launch(out: Path, *args: str, launcher: tuple[str, ...] = ("-n", "4", "--min_ranks", "2"),
           run: str = "run") -> subprocess.Popen[str]:
    """``lockstep LAUNCHER elastic_job.py OUT ARGS`` (OUT made if need be; the run folder in it)."""
    out.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "lockstep", *launcher, "--run_directory", str(out / run),
                             str(JOB), str(out), *args], cwd=REPO, env=launcher_env(args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> str:
    """The launcher's stderr, once it exited 0."""
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return err


def global_batches(out: Path) -> dict[int, list[int]]:
    """Each step's samples over every rank, as the newest generation that read them trained them."""
    read: dict[int, dict[int, list[int]]] = {}
    for log in out.glob("samples*"):
        for line in log.read_text().splitlines():
            generation, step, samples = json.loads(line)
            read.setdefault(step, {}).setdefault(generation, []).extend(samples)
    return {step: sorted(by[max(by)]) for step, by in sorted(read.items())}


def assert_as_uninterrupted(out: Path, reference: Reference) -> None:
    """The uninterrupted run's parameters (within 1e-5) and global batches, and no checkpoint."""
    params, batches = reference
    assert_same_params(torch.load(out / "params.pt", weights_only=True), params, atol=1e-5)
    assert global_batches(out) == batches
    assert not [p for p in out.rglob("*.pt") if p.name != "params.pt"]  # no checkpoint, so none read
