"""A Composer script, renamed `composer` -> `lockstep`, trains under `lockstep -n 2`.

The script (tests/fixtures/composer/train_classifier.py) is Composer code as written for Composer
0.32.1, which runs it unchanged (scripts/composer_reference/setup.sh makes a venv for that). Here
the rename is the only change."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "fixtures" / "composer" / "train_classifier.py"


def renamed(source: str) -> str:
    return re.sub(r"\bcomposer\b", "lockstep", source)


@pytest.mark.timeout(240)
def test_a_renamed_composer_script_trains_on_two_ranks(tmp_path: Path) -> None:
    script, out = tmp_path / "train.py", tmp_path / "result.txt"
    script.write_text(renamed(SCRIPT.read_text()))
    assert "from lockstep.models import ComposerClassifier" in script.read_text()
    assert not re.search(r"^\s*(from|import) composer\b", script.read_text(), re.MULTILINE)
    run = subprocess.run([sys.executable, "-m", "lockstep", "-n", "2", str(script), str(out)], cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=220)
    assert run.returncode == 0, run.stderr[-3000:]
    accuracy, batches, epochs = out.read_text().split()
    # 6 epochs of 192 samples in global batches of 32 (16 per rank), unless EarlyStopper ends it sooner
    assert int(batches) == 6 * int(epochs) and 1 <= int(epochs) <= 6
    assert float(accuracy) > 0.8  # the task is linearly separable: a trained model gets most right
