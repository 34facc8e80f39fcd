"""Composer's own code, renamed `composer` -> `lockstep`, runs under the lockstep launcher.

The fixtures in tests/fixtures/composer are Composer's text (its checkpoint/autoresume and early
stopping notebooks, the code of its trainer docs) with only the changes each header lists: offline
synthetic data instead of downloads, smaller batches. Here the rename is the only change. Each
fixture also runs under Composer 0.32.1 itself (the venv of scripts/composer_reference/setup.sh);
there the early stopping notebook's runs also last 5 epochs and 1."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures" / "composer"


def run_renamed(fixture: str, folder: Path, ranks: int, *args: str, timeout: float,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``fixture`` renamed to lockstep as ``folder/train.py`` under ``lockstep -n ranks``."""
    folder.mkdir(parents=True, exist_ok=True)
    source = re.sub(r"\bcomposer\b", "lockstep", (FIXTURES / fixture).read_text())
    assert not re.search(r"^\s*(from|import) composer\b", source, re.MULTILINE)
    (folder / "train.py").write_text(source)
    if not (folder / "offline_torchvision").exists():
        shutil.copytree(FIXTURES / "offline_torchvision", folder / "offline_torchvision")
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "-n", str(ranks), "--run_directory", str(folder / "run"), "train.py",
         *args], cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})},
        capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_the_autoresume_notebook_killed_after_two_epochs_resumes_when_run_again(tmp_path: Path) -> None:
    from lockstep.checkpoint import export_state_dict

    seed = {"OFFLINE_TORCHVISION_SEED": "7"}  # both runs build the model from the same initial weights
    whole = run_renamed("checkpoint_autoresume.py", tmp_path / "whole", 1, timeout=120, env=seed)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "Number of epochs trained: 5ep" in whole.stdout
    # An epoch reads 5 batches of 32 to train and 5 to evaluate: the 720th image is in epoch 3
    folder = tmp_path / "killed"
    killed = run_renamed("checkpoint_autoresume.py", folder, 1, timeout=120,
                         env={**seed, "OFFLINE_TORCHVISION_KILL_AFTER": "720"})
    checkpoints = folder / "my_autoresume_training_run"
    assert killed.returncode != 0 and "Number of epochs trained" not in killed.stdout
    first = checkpoints / "ep1-ba5-rank0.pt"
    assert first.exists() and not (checkpoints / "ep3-ba15-rank0.pt").exists()
    written = first.stat().st_mtime_ns
    again = run_renamed("checkpoint_autoresume.py", folder, 1, timeout=120, env=seed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Number of epochs trained: 5ep" in again.stdout
    assert first.stat().st_mtime_ns == written  # not trained and saved again
    # resumed, not started over: the weights equal the uninterrupted run's bit for bit
    expected = export_state_dict(tmp_path / "whole" / "my_autoresume_training_run" / "latest-rank0.pt")
    resumed = export_state_dict(checkpoints / "latest-rank0.pt")
    assert expected.keys() == resumed.keys()
    for name, value in expected.items():
        assert torch.equal(value, resumed[name]), name


@pytest.mark.timeout(300)
def test_the_early_stopping_notebook_stops_each_run_before_its_100_epochs(tmp_path: Path) -> None:
    done = run_renamed("early_stopping.py", tmp_path, 1, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    runs: list[list[dict]] = []  # each Trainer's evaluations, in the notebook's order
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "eval":
            if not runs or record["epoch"] <= runs[-1][-1]["epoch"]:  # a new Trainer starts at epoch 0
                runs.append([])
            runs[-1].append(record)
    early, threshold = runs
    accuracies = [r["metrics/eval/MulticlassAccuracy"] for r in early]
    # EarlyStopper(patience=1): it ends the run once the best accuracy is more than an epoch old
    best = accuracies.index(max(accuracies))
    assert len(accuracies) == best + 3 < 100  # Composer: stops when epochs since the best > patience
    # ThresholdStopper(threshold=0.3): the first evaluation of the trained model is above it
    assert [r["epoch"] for r in threshold] == [1] and threshold[0]["metrics/eval/MulticlassAccuracy"] >= 0.3


@pytest.mark.timeout(300)
def test_the_trainer_docs_callback_scheduler_and_evaluator_code_runs_on_two_ranks(tmp_path: Path) -> None:
    done = run_renamed("docs_snippets.py", tmp_path, 2, "out.json", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    # What Composer 0.32.1 gives running this same file (WandBLogger left out: that venv has no wandb)
    expected = json.loads((FIXTURES / "docs_snippets_composer.json").read_text())
    assert results["cosine"] == pytest.approx(expected["cosine"], rel=1e-12)
    # A known difference (docs/porting-from-composer.md): Composer steps its schedulers before the
    # timestamp counts the batch, so each lr comes one batch late; lockstep's lr for batch k is the
    # schedule at k. With one batch an epoch, lockstep's lr at epoch k's end is Composer's at k + 1's.
    for name in ("multistep", "ssr", "ssr_equivalent", "warmup", "warmup_scaled"):
        assert results[name][:-1] == pytest.approx(expected[name][1:], rel=1e-12), name
    assert results["glue"]["glue_mrpc"]["MulticlassAccuracy"] == expected["glue"]["glue_mrpc"]["MulticlassAccuracy"]
    assert results["ssr"] == results["ssr_equivalent"]  # the docs' claim
    assert results["callbacks"] == 2
    for epoch in ("0ep", "1ep"):  # EpochMonitor, both ways (the console shows rank 0's output)
        assert done.stdout.count(f"Epoch: {epoch}") == 2
    assert results["eval"] == ["BinaryF1Score", "MulticlassAccuracy", "loss"]
    glue = results["glue"]
    assert set(glue) == {"glue_mrpc", "glue_mnli"}
    assert set(glue["glue_mrpc"]) == {"BinaryF1Score", "MulticlassAccuracy", "loss"}
    assert set(glue["glue_mnli"]) == {"MulticlassAccuracy", "loss"}
    assert glue["glue_mrpc"]["MulticlassAccuracy"] == glue["glue_mnli"]["MulticlassAccuracy"]  # the same data


@pytest.mark.timeout(200)
def test_nan_monitor_fails_a_diverging_run_on_two_ranks(tmp_path: Path) -> None:
    done = run_renamed("nan_monitor.py", tmp_path, 2, timeout=150)
    assert done.returncode != 0
    assert "Train loss contains a NaN." in done.stderr
    assert "unreachable" not in done.stdout
