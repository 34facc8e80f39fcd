"""Checkpoints in a bucket, in one process: save_folder='s3://...', rotation, the latest pointer
object, load_path from the bucket and load_object_store, the errors found at Trainer(...), and
the upload queue's bound."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch

from lockstep import Callback, Trainer
from lockstep.checkpoint.remote import RemoteFolder, Uploader
from lockstep.objectstore import S3ObjectStore
from tests.helpers import trainer_params
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(90)


def _trainer(**kwargs) -> Trainer:
    torch.manual_seed(0)
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
                   device="cpu", progress_bar=False, seed=3, **kwargs)


def _objects(bucket: str) -> dict[str, bytes]:
    store = S3ObjectStore(bucket)
    return {k: store.read_bytes(k) for k in store.list_objects("")}


def test_saves_go_to_the_bucket_with_pointer_and_rotation(bucket: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = _trainer(max_duration="6ba", run_name="r1", save_folder=f"s3://{bucket}/runs/{{run_name}}",
                       save_interval="2ba", save_num_checkpoints_to_keep=2)
    trainer.fit()
    objects = _objects(bucket)
    assert sorted(objects) == ["runs/r1/ep0-ba4-rank0.pt", "runs/r1/ep0-ba6-rank0.pt",
                               "runs/r1/latest-rank0.pt.symlink"]
    assert objects["runs/r1/latest-rank0.pt.symlink"] == b"runs/r1/ep0-ba6-rank0.pt"
    assert not Path("s3:").exists()
    local = tmp_path / ".lockstep" / "s3" / bucket / "runs" / "r1"
    assert (local / "ep0-ba6-rank0.pt").read_bytes() == objects["runs/r1/ep0-ba6-rank0.pt"]
    expected = trainer_params(trainer)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for kwargs in ({"load_path": f"s3://{bucket}/runs/r1/ep0-ba6-rank0.pt"},
                   {"load_path": "runs/r1/ep0-ba6-rank0.pt", "load_object_store": S3ObjectStore(bucket)}):
        loaded = _trainer(max_duration="6ba", **kwargs)
        assert loaded.state.timestamp.batch.value == 6
        for k, v in expected.items():
            assert torch.equal(v, loaded.state.model.state_dict()[k]), k


def test_a_save_folder_that_holds_checkpoints_is_refused(bucket: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _trainer(max_duration="2ba", run_name="r2", save_folder=f"s3://{bucket}/r2", save_interval="2ba").fit()
    monkeypatch.chdir(tmp_path / ".lockstep")  # no local copy: the bucket's objects are found
    error = error_of(_trainer, max_duration="2ba", run_name="r2", save_folder=f"s3://{bucket}/r2")
    assert f"s3://{bucket}/r2/" in error and "save_overwrite=True" in error


@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials", "unreachable endpoint", "other scheme"])
def test_bad_bucket_settings_are_one_line_at_construction(bucket: str, case: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name, expected = bucket, ""
    if case == "missing bucket":
        name, expected = "no-such-bucket", "does not exist"
    elif case == "wrong credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        expected = "AWS_ACCESS_KEY_ID"
    elif case == "unreachable endpoint":
        monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")
        expected = "S3_ENDPOINT_URL"
    scheme = "gs" if case == "other scheme" else "s3"
    ran = []
    error = error_of(_trainer, max_duration="2ba", save_folder=f"{scheme}://{name}/x",
                     callbacks=[_Spy(ran)])
    assert f"{name}" in error and expected in error and "\n" not in error, error
    assert not ran  # before any step
    for uri in (f"{scheme}://{name}/x/ep0-ba2-rank0.pt",):
        error = error_of(_trainer, max_duration="2ba", load_path=uri)
        assert name in error and "\n" not in error, error


class _Spy(Callback):
    def __init__(self, ran: list) -> None:
        self.ran = ran

    def batch_start(self, state, logger) -> None:
        self.ran.append(state.timestamp.batch.value)


class _StopServerAfter(Callback):
    """Kills the S3 server once batch ``batch`` is done and ``uploaded`` is in the bucket: every
    later upload fails."""

    def __init__(self, server, batch: int, uploaded: str) -> None:
        self.server, self.batch, self.uploaded = server, batch, uploaded
        self.trainer: Trainer | None = None

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch.value == self.batch:
            assert self.trainer is not None and self.trainer.saver is not None
            uploader, deadline = self.trainer.saver.uploader, time.monotonic() + 30
            while self.uploaded not in uploader.state()[0]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            self.server.process.kill()
            self.server.process.wait()


@pytest.mark.timeout(120)
def test_an_upload_that_fails_for_good_fails_the_job_naming_the_object(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import seaweed

    server = seaweed.start()  # its own server: this test kills it
    try:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        server.create_bucket("doomed")
        monkeypatch.chdir(tmp_path)
        stop = _StopServerAfter(server, 3, "ep0-ba2-rank0.pt")
        trainer = stop.trainer = _trainer(max_duration="8ba", save_folder="s3://doomed/x", save_interval="2ba",
                                          callbacks=[stop])
        with pytest.raises(RuntimeError) as e:
            trainer.fit()
        message = str(e.value)
        # the first object that could not go up: the pointer to batch 2, or batch 4's checkpoint
        assert re.search(r"s3://doomed/x/(latest-rank0\.pt\.symlink|ep0-ba4-rank0\.pt) after 3 attempts", message), message
        assert "\n" not in message
        assert trainer.state.timestamp.batch.value in (6, 8)  # at the next save, or at the end of fit
    finally:
        server.stop()


@pytest.mark.parametrize(("keep", "sent"), [(1, ["ck1", "ck3"]), (2, ["ck1", "ck2", "ck3"]),
                                            (-1, ["ck1", "ck2", "ck3"])])
def test_a_checkpoint_overtaken_while_it_waits_to_upload_is_dropped(bucket: str, tmp_path: Path, keep: int,
                                                                    sent: list[str]) -> None:
    """While the first (large) checkpoint uploads, two more arrive. With the bucket keeping only the
    newest one, the middle one, which rotation would delete once the newest is up, is never sent
    and its links are gone; keeping two, or all, every one is sent, in order."""
    folder = RemoteFolder.of(f"s3://{bucket}/runs/queue{keep}", tmp_path / "staging")
    (tmp_path / "ck1").write_bytes(os.urandom(48 * 2**20))
    for name in ("ck2", "ck3"):
        (tmp_path / name).write_bytes(name.encode() * 1000)
    uploader = Uploader(folder, 0, keep=keep)
    try:
        for name in ("ck1", "ck2", "ck3"):
            uploader.upload(name, [(tmp_path / name, name)])
        uploader.drain()
        state = uploader.state()
    finally:
        uploader.close()
    assert state == (sent, None)
    assert uploader.dropped == [n for n in ("ck1", "ck2", "ck3") if n not in sent]
    assert sorted(folder.store.list_objects(folder.key_of(""))) == [folder.key_of(n) for n in sent]
    assert [p for p in (tmp_path / "staging").rglob("*") if p.is_file()] == []


def test_a_checkpoint_still_waiting_when_its_deletion_is_asked_is_never_sent(bucket: str, tmp_path: Path) -> None:
    """Rotation deletes a checkpoint that still waits behind a long upload: it is dropped, not sent
    after its deletion (where nothing would delete it again)."""
    folder = RemoteFolder.of(f"s3://{bucket}/runs/rotated", tmp_path / "staging")
    (tmp_path / "ck1").write_bytes(os.urandom(48 * 2**20))
    for name in ("ck2", "ck3"):
        (tmp_path / name).write_bytes(name.encode() * 1000)
    uploader = Uploader(folder, 0)
    try:
        for name in ("ck1", "ck2", "ck3"):
            uploader.upload(name, [(tmp_path / name, name)])
        uploader.publish("ck1", folder.key_of("ck1"), None, ["ck2"])
        uploader.drain()
        state = uploader.state()
    finally:
        uploader.close()
    assert state == (["ck1", "ck3"], None) and uploader.dropped == ["ck2"]
    assert sorted(folder.store.list_objects(folder.key_of(""))) == [folder.key_of("ck1"), folder.key_of("ck3")]
