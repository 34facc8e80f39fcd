"""mosaicml-streaming's StreamingDataset under lockstep's launcher and Trainer, as Composer's users
train on it: built before the Trainer (it makes a process group of its own and destroys it), saved
in each checkpoint as ``dataset_state``, and resumed mid-epoch by the dataset itself, with nothing
spun or passed over (issue 51). ``make setup`` installs it beside the venv
(``scripts/install_streaming.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_bitwise, launcher_env
from tests.trainer.common import assert_same_params

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("streaming_job.py")
STREAMING = Path(sys.prefix) / "streaming"


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    if not (STREAMING / "streaming").is_dir():
        if os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"):  # make test: everything is installed
            pytest.fail(f"mosaicml-streaming is not in {STREAMING}: run scripts/install_streaming.sh {sys.prefix}")
        pytest.skip("mosaicml-streaming is not installed beside the venv (make setup installs it)")
    path = os.pathsep.join(p for p in (str(STREAMING), os.environ.get("PYTHONPATH")) if p)
    return launcher_env([], {"PYTHONPATH": path, "LOCKSTEP_PREFORK": "+streaming"})


def _run(env: dict[str, str], ranks: int, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lockstep", "-n", str(ranks), str(JOB), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-4000:]


def _global_batches(out: Path) -> dict[int, list[int]]:
    read: dict[int, list[int]] = {}
    for log in out.glob("samples*"):
        for line in log.read_text().splitlines():
            batch, samples = json.loads(line)
            read.setdefault(batch, []).extend(samples)
    return {batch: sorted(samples) for batch, samples in sorted(read.items())}


def test_a_streaming_dataset_resumes_mid_epoch_on_as_many_ranks_or_more_as_the_uninterrupted_run_read_it(
        env: dict[str, str], tmp_path: Path) -> None:
    data, first, resumed, wider = (tmp_path / name for name in ("mds", "first", "resumed", "wider"))
    done = subprocess.run([sys.executable, str(JOB), "write", str(data)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    first.mkdir(), resumed.mkdir(), wider.mkdir()
    _run(env, 2, "train", str(data), str(first), "4")
    batches = _global_batches(first)
    assert len(batches) == 16
    for epoch in (range(0, 8), range(8, 16)):  # every sample once an epoch
        assert sorted(i for b in epoch for i in batches[b]) == list(range(64))
    # batch 9 is the second of epoch 1: the dataset puts itself after the first 8 samples of it
    saved = str(first / "ck" / "ep1-ba9-rank0.pt")
    _run(env, 2, "train", str(data), str(resumed), "4", saved)
    assert _global_batches(resumed) == {b: s for b, s in batches.items() if b >= 9}
    params = torch.load(first / "params.pt", weights_only=True)
    assert_bitwise(torch.load(resumed / "params.pt", weights_only=True), params)
    # on 4 ranks of 2 samples, the same global batch: streaming's own rule for another number of
    # ranks (the same num_canonical_nodes) gives every batch the same samples
    _run(env, 4, "train", str(data), str(wider), "2", saved)
    assert _global_batches(wider) == {b: s for b, s in batches.items() if b >= 9}
    assert_same_params(torch.load(wider / "params.pt", weights_only=True), params, atol=1e-6)
