"""URIs that are almost right are one-line errors at Trainer(...) (issue 49): ``s3:/bucket/x`` (one
slash, which was a local folder ``./s3:/bucket/x``) and a query or fragment (which was dropped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep import Trainer
from lockstep.loggers import RemoteUploaderDownloader
from lockstep.objectstore import S3ObjectStore
from lockstep.objectstore.uri import check_path, check_uri
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(180)  # 46 s seen on a loaded 2-core machine


def _trainer(**kwargs) -> Trainer:
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters()),
                   device="cpu", progress_bar=False, max_duration="2ba", **kwargs)


@pytest.mark.parametrize("scheme", ["s3", "S3", "gs", "azure", "az", "oci"])
@pytest.mark.parametrize("argument", ["save_folder", "load_path"])
def test_one_slash_after_a_known_scheme_is_an_error_naming_the_uri_meant(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str, argument: str) -> None:
    monkeypatch.chdir(tmp_path)
    path = f"{scheme}:/{bucket}/x" + ("/ep0-ba2-rank0.pt" if argument == "load_path" else "")
    error = error_of(_trainer, **{argument: path}, expected=(ValueError,))
    assert f"write '{scheme.lower()}://{bucket}/x" in error and argument in error and "\n" not in error, error
    assert list(tmp_path.iterdir()) == []  # no local folder named 's3:'


@pytest.mark.parametrize("suffix", ["?versionId=3", "#frag", "?"])
@pytest.mark.parametrize("argument", ["save_folder", "load_path"])
def test_a_query_or_fragment_is_an_error_not_dropped(bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      suffix: str, argument: str) -> None:
    monkeypatch.chdir(tmp_path)
    if argument == "load_path":  # a checkpoint that the URI without its query would load
        _trainer(save_folder=f"s3://{bucket}/x", save_interval="2ba").fit()
    path = f"s3://{bucket}/x" + ("/ep0-ba2-rank0.pt" if argument == "load_path" else "") + suffix
    error = error_of(_trainer, **{argument: path}, expected=(ValueError,))
    assert repr(suffix) in error and argument in error and "\n" not in error, error
    if argument == "save_folder":
        assert S3ObjectStore(bucket).list_objects("") == []


def test_the_same_checks_everywhere_a_uri_is_taken(s3_env: dict[str, str]) -> None:
    for uri in ("s3:/b/logs", "s3://b/logs?x=1"):
        with pytest.raises(ValueError, match="bucket_uri"):
            RemoteUploaderDownloader(uri)
    with pytest.raises(ValueError, match="dbfs: object stores are not supported"):
        check_path("dbfs:/Volumes/a/b", "save_folder")
    for fine in ("local/s3:/x", "s3-runs/x", "./s3:x", None):
        check_path(fine, "save_folder")
    assert check_uri("s3://b/p/{run_name}", "save_folder") == ("b", "p/{run_name}")
