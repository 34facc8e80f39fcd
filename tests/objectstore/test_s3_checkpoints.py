"""Checkpoints in a bucket, in one process: save_folder='s3://...', rotation, the latest pointer
object, load_path from the bucket and load_object_store, and the errors found at Trainer(...)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep import Trainer
from lockstep.objectstore import S3ObjectStore
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(90)


def _trainer(**kwargs) -> Trainer:
    torch.manual_seed(0)
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
                   device="cpu", progress_bar=False, seed=3, **kwargs)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}


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
    expected = _params(trainer)

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


class _Spy:
    def __init__(self, ran: list) -> None:
        self.ran = ran

    def run_event(self, event, state, logger) -> None:
        self.ran.append(event)
