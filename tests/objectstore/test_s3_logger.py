"""RemoteUploaderDownloader against a real S3 server: the run folder's metrics.jsonl, TensorBoard
events and loss curve reach the bucket; overwrite=False is kept; a bad bucket is one line at
Trainer(...)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep import Trainer
from lockstep.loggers import RemoteUploaderDownloader, TensorboardLogger
from lockstep.objectstore import S3ObjectStore
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(90)


def _trainer(**kwargs) -> Trainer:
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                   device="cpu", progress_bar=False, max_duration="4ba", **kwargs)


def test_run_folder_files_reach_the_bucket(bucket: str, tmp_path: Path) -> None:
    remote = RemoteUploaderDownloader(f"s3://{bucket}/logs")
    trainer = _trainer(run_name="r", run_folder=str(tmp_path / "run"), loggers=[remote, TensorboardLogger()])
    trainer.fit()
    trainer.close()
    store = S3ObjectStore(bucket)
    keys = store.list_objects("logs/r/")
    assert "logs/r/metrics.jsonl" in keys and "logs/r/loss_curve.png" in keys, keys
    assert any("/tensorboard/" in k and "events.out.tfevents" in k for k in keys), keys
    for name in ("metrics.jsonl", "loss_curve.png"):
        assert store.read_bytes(f"logs/r/{name}") == (tmp_path / "run" / name).read_bytes()
    assert remote.get_uri_for_file("a/b.txt") == f"s3://{bucket}/logs/a/b.txt"
    remote.download_file("r/metrics.jsonl", str(tmp_path / "back.jsonl"))  # a name under the bucket_uri
    assert (tmp_path / "back.jsonl").read_bytes() == (tmp_path / "run" / "metrics.jsonl").read_bytes()


def test_overwrite_false_keeps_an_existing_object(bucket: str, tmp_path: Path) -> None:
    remote = RemoteUploaderDownloader(f"s3://{bucket}", file_path_format_string="{run_name}/{remote_file_name}")
    trainer = _trainer(run_name="r2", loggers=[remote])
    (tmp_path / "a.txt").write_text("first")
    trainer.logger.upload_file("notes/a.txt", tmp_path / "a.txt")
    remote.wait_for_workers()
    assert S3ObjectStore(bucket).read_bytes("r2/notes/a.txt") == b"first"
    (tmp_path / "a.txt").write_text("second")
    fresh = RemoteUploaderDownloader(f"s3://{bucket}", file_path_format_string="{run_name}/{remote_file_name}")
    fresh.init(trainer.state, trainer.logger)
    fresh.upload_file(trainer.state, "notes/a.txt", tmp_path / "a.txt", overwrite=False)
    with pytest.raises(RuntimeError, match=f"s3://{bucket}/r2/notes/a.txt already exists and overwrite=False"):
        fresh.wait_for_workers()
    assert S3ObjectStore(bucket).read_bytes("r2/notes/a.txt") == b"first"
    fresh.upload_file(trainer.state, "notes/a.txt", tmp_path / "a.txt", overwrite=True)
    fresh.wait_for_workers()
    assert S3ObjectStore(bucket).read_bytes("r2/notes/a.txt") == b"second"


def test_a_missing_bucket_is_one_line_at_construction(s3_env: dict[str, str]) -> None:
    error = error_of(_trainer, loggers=[RemoteUploaderDownloader("s3://no-such-logs-bucket")])
    assert "'no-such-logs-bucket'" in error and "does not exist" in error and "\n" not in error, error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_procs", [True, False])
def test_uploads_with_and_without_a_child_process_keep_going_after_a_failure(bucket: str, tmp_path: Path,
                                                                            use_procs: bool) -> None:
    """One file that may not be overwritten fails; the files after it still go up (they do not
    depend on each other), and the failure is raised once."""
    remote = RemoteUploaderDownloader(f"s3://{bucket}/p", use_procs=use_procs,
                                      backend_kwargs={"client_config": {"connect_timeout": 5}})
    trainer = _trainer(run_name="r3", loggers=[remote])
    S3ObjectStore(bucket).upload_bytes("p/taken.txt", b"kept")
    for name in ("taken.txt", "after.txt"):
        (tmp_path / name).write_text(name)
        trainer.logger.upload_file(name, tmp_path / name)
    with pytest.raises(RuntimeError, match=f"s3://{bucket}/p/taken.txt already exists and overwrite=False"):
        remote.wait_for_workers()
    assert S3ObjectStore(bucket).read_bytes("p/taken.txt") == b"kept"
    assert S3ObjectStore(bucket).read_bytes("p/after.txt") == b"after.txt"
    assert not any((Path(remote._staging_folder())).iterdir())  # the staged copies are removed
    remote.wait_for_workers()  # raised once
    trainer.close()
