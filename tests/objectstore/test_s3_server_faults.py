"""The S3 server itself fails in the middle of a run (issue 49 item 9), on a server of the test's
own: paused (SIGSTOP, then SIGCONT), uploads wait and nothing is lost; killed (SIGKILL), the job
fails in one line naming the bucket, and once the server is back (same data) a job on a fresh disk
autoresumes from the newest checkpoint the bucket holds whole and ends bit for bit where an
uninterrupted run does."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lockstep import Callback, Trainer
from lockstep.objectstore import S3ObjectStore
from tests.helpers import assert_bitwise, trainer_params
from tests.trainer.common import MLP, loader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import seaweed  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def own_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[seaweed.SeaweedServer]:
    server = seaweed.start()
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)  # a paused server would not stop
        server.stop()


class Slowly(Callback):
    """Sleeps after each batch until ``until``: the uploads of the first checkpoints end, and the
    bucket's pointer moves, before what the test does at that batch (on a fast machine the whole
    run would otherwise be over before the first upload process has started)."""

    def __init__(self, until: int, seconds: float = 0.5) -> None:
        self.until, self.seconds = until, seconds

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch.value < self.until:
            time.sleep(self.seconds)


class At(Callback):
    """Runs ``action`` once, after batch ``batch``."""

    def __init__(self, batch: int, action: Callable[[], None]) -> None:
        self.batch, self.action = batch, action

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch.value == self.batch:
            self.action()


def _trainer(batches: int, folder: str | None, *callbacks: Callback) -> Trainer:
    torch.manual_seed(0)
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
                   device="cpu", progress_bar=False, seed=3, max_duration=f"{batches}ba", run_name="r",
                   save_folder=folder, save_interval="2ba", save_num_checkpoints_to_keep=2, autoresume=folder is not None,
                   callbacks=list(callbacks))


def test_a_paused_server_delays_the_uploads_and_loses_nothing(own_server, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    bucket = own_server.create_bucket("paused")
    reference = _trainer(8, None)
    reference.fit()
    pid = own_server.process.pid

    def pause() -> None:
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(3.0, os.kill, (pid, signal.SIGCONT)).start()

    trainer = _trainer(8, f"s3://{bucket}/run", At(3, pause))
    trainer.fit()
    trainer.close()
    assert_bitwise(trainer_params(trainer), trainer_params(reference))
    store = S3ObjectStore(bucket)
    assert sorted(store.list_objects("run/")) == ["run/ep0-ba6-rank0.pt", "run/ep1-ba8-rank0.pt",
                                                  "run/latest-rank0.pt.symlink"]
    assert store.read_bytes("run/latest-rank0.pt.symlink") == b"run/ep1-ba8-rank0.pt"
    local = tmp_path / ".lockstep" / "s3" / bucket / "run" / "ep1-ba8-rank0.pt"
    assert store.read_bytes("run/ep1-ba8-rank0.pt") == local.read_bytes()


def test_a_killed_server_fails_the_job_in_one_line_and_once_back_the_run_resumes_exactly(
        own_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    bucket = own_server.create_bucket("killed")
    reference = _trainer(12, None)
    reference.fit()

    def kill() -> None:
        own_server.process.kill()
        own_server.process.wait()

    first = tmp_path / "first"
    first.mkdir()
    monkeypatch.chdir(first)
    trainer = _trainer(12, f"s3://{bucket}/run", Slowly(7), At(7, kill))
    with pytest.raises(RuntimeError) as failed:
        trainer.fit()
    trainer.close()
    message = str(failed.value)
    assert message.startswith(f"uploading checkpoints to s3://{bucket}/run failed") and "\n" not in message

    # The same data: what reached the bucket before the kill is there. The job starts the moment S3
    # answers again, while reads still fail with InternalError for a second or two (the volume
    # servers are not back): the client's retries ride that out.
    seaweed.restart(own_server, until_reads=False)
    fresh = tmp_path / "fresh"  # another machine: only the bucket holds the run
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    resumed = _trainer(12, f"s3://{bucket}/run")
    store = S3ObjectStore(bucket)
    try:  # the newest checkpoint whose upload ended before the kill (usually batch 4)
        pointed = int(re.search(r"-ba(\d+)-", store.read_bytes("run/latest-rank0.pt.symlink").decode())[1])
    except FileNotFoundError:  # on a machine too slow for any upload to end first: a fresh start
        pointed = 0
    assert resumed.state.timestamp.batch.value == pointed
    resumed.fit()
    resumed.close()
    assert_bitwise(trainer_params(resumed), trainer_params(reference))
    assert store.read_bytes("run/latest-rank0.pt.symlink") == b"run/ep1-ba12-rank0.pt"


def test_an_endpoint_that_stops_answering_at_autoresume_is_one_line_in_seconds(
        own_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A black hole: the server takes the connection and never answers (paused). The job does not
    wait on it for minutes (the client's read timeout and retries): it stops at Trainer(...)."""
    monkeypatch.chdir(tmp_path)
    bucket = own_server.create_bucket("hole")
    trainer = _trainer(4, f"s3://{bucket}/run")
    trainer.fit()
    trainer.close()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    os.kill(own_server.process.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(Exception) as failed:
        _trainer(8, f"s3://{bucket}/run")
    took = time.monotonic() - started
    message = str(failed.value)
    assert f"'{bucket}'" in message and "does not answer" in message and "\n" not in message, message
    assert took < 30, f"{took:.0f} s"  # before the probe went through the quick client: 185 s
