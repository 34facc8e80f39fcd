"""The README's main job, end to end through the launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def train_digits(tmp_path: Path, *args: str, timeout: float) -> None:
    """Run the example on 2 ranks for 4 epochs; it must learn and warn about nothing."""
    result = subprocess.run(
        [sys.executable, "-m", "lockstep", "-n", "2", "--run_directory", str(tmp_path / "run"),
         str(ROOT / "examples" / "train_digits.py"), "--epochs", "4", *args],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    match = re.search(r"final eval: accuracy (\d\.\d+), loss (\d+\.\d+)", result.stdout + result.stderr)
    assert match is not None, result.stdout + result.stderr
    assert float(match.group(1)) > 0.85
    assert "Warning" not in result.stderr


@pytest.mark.timeout(180)
def test_train_digits_under_the_launcher(tmp_path: Path) -> None:
    train_digits(tmp_path, timeout=150)
    for name in ("metrics.jsonl", "loss_curve.png", "trainer-rank0.log", "trainer-rank1.log", "rank1.stdout.log"):
        assert (tmp_path / "run" / name).exists(), name


@pytest.mark.timeout(240)
def test_train_digits_with_zero3_under_the_launcher(tmp_path: Path) -> None:
    from tests.trainer.test_deepspeed import HAVE_DEEPSPEED
    if not HAVE_DEEPSPEED and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"):
        pytest.skip("DeepSpeed is not installed (pip install 'torch-lockstep[deepspeed]')")
    # the first DeepSpeed run on a machine compiles its shared-memory op (about a minute)
    train_digits(tmp_path, "--zero-stage", "3", timeout=220)


@pytest.mark.timeout(180)
def test_train_digits_with_zero1_in_one_process_without_the_launcher(tmp_path: Path) -> None:
    from tests.trainer.test_deepspeed import HAVE_DEEPSPEED
    if not HAVE_DEEPSPEED and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"):
        pytest.skip("DeepSpeed is not installed (pip install 'torch-lockstep[deepspeed]')")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "2", "--zero-stage", "1"],
        cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=160)
    assert result.returncode == 0, result.stderr
    assert "1 rank(s)" in result.stdout


@pytest.mark.timeout(240)
def test_finetune_hf_trains_under_fsdp_exports_and_reloads(tmp_path: Path) -> None:
    """examples/finetune_hf.py: a GPT-2 from a config fine-tunes under FSDP on 2 ranks, and the Hugging
    Face folder written from its sharded checkpoint reloads to the trained model's exact logits."""
    result = subprocess.run(
        [sys.executable, "-m", "lockstep", "-n", "2", str(ROOT / "examples" / "finetune_hf.py"),
         "--max_duration", "16ba", "--files", "20"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "from_pretrained's logits equal the trained model's" in result.stdout, result.stdout
    first, last = map(float, re.search(r"train loss (\d+\.\d+) -> (\d+\.\d+)", result.stdout).groups())
    assert last < first - 1.0  # from about ln(257) = 5.5 nats per byte
    assert (tmp_path / "runs" / "finetune_hf" / "huggingface" / "tokenizer.json").exists()
