"""Checkpoints written by Composer 0.32.1 itself load into lockstep, and training continues as
Composer continued it.

tests/fixtures/composer/checkpoints/ was made by scripts/composer_reference/make_checkpoints.py
in a venv running Composer: tests/fixtures/composer/resume_classifier.py (Composer code) trained on
2 CPU ranks, saved at batch 6 (mid-epoch) under DDP (a monolithic .pt) and under FSDP (a sharded
DCP folder), and Composer resumed each to batch 12 and kept the parameters. Here the same script,
with `composer` renamed to `lockstep`, resumes those checkpoints under `lockstep -n 2`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint import export_state_dict
from tests.fixtures.numerics import for_this_machine

FIXTURES = Path(__file__).parents[1] / "fixtures" / "composer"
CHECKPOINTS = FIXTURES / "checkpoints"
SRC = Path(__file__).parents[2] / "src"


def resume(tmp_path: Path, checkpoint: str, *flags: str) -> dict:
    script, out = tmp_path / "train.py", tmp_path / "params.pt"
    script.write_text(re.sub(r"\bcomposer\b", "lockstep", (FIXTURES / "resume_classifier.py").read_text()))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "lockstep", "-n", "2", str(script), "resume",
                          str(CHECKPOINTS / checkpoint), str(out), *flags],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint, flags, composers", [
    ("monolithic.pt", (), "continued_monolithic.pt"),       # DDP, as Composer saved and resumed it
    ("sharded", ("sharded",), "continued_sharded.pt"),       # FSDP, likewise
    ("monolithic.pt", ("sharded",), "continued_monolithic.pt"),  # Composer's DDP file, resumed under FSDP
])
def test_lockstep_continues_a_composer_checkpoint_as_composer_did(tmp_path: Path, checkpoint: str, flags: tuple,
                                                                   composers: str) -> None:
    """Model, optimizer (DecoupledAdamW's moments), LambdaLR's step count, timestamp (mid-epoch: the
    sampler passes over the 6 batches of epoch 0 already trained, then epoch 1 reshuffles) and every rank's RNG (dropout) all come
    back: lockstep's 6 further batches end at Composer's parameters, bit for bit."""
    ours, theirs = resume(tmp_path, checkpoint, *flags), torch.load(for_this_machine(CHECKPOINTS / composers), weights_only=True)
    assert ours["batch"] == theirs["batch"] == 12
    assert ours["params"].keys() == theirs["params"].keys()
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), f"{name} differs from Composer's"


def test_composers_checkpoints_export_their_weights() -> None:
    """The monolithic file and the sharded folder hold the same model (Composer's DDP and FSDP runs
    agree bit for bit), which export_state_dict reads from either."""
    monolithic, sharded = export_state_dict(CHECKPOINTS / "monolithic.pt"), export_state_dict(CHECKPOINTS / "sharded")
    assert sorted(monolithic) == ["module.0.bias", "module.0.weight", "module.3.bias", "module.3.weight"]
    for name, value in monolithic.items():
        assert torch.equal(sharded[name], value)
