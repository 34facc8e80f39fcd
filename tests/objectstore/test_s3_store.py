"""S3ObjectStore and the probe against a real SeaweedFS server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lockstep.objectstore import ObjectStore, S3ObjectStore, parse_uri, store_for_uri
from lockstep.objectstore.probe import problem

pytestmark = pytest.mark.timeout(60)


def test_round_trip_in_parts(bucket: str, tmp_path: Path) -> None:
    store = S3ObjectStore(bucket, prefix="runs/a")
    assert isinstance(store, ObjectStore)
    data = os.urandom((40 << 20) + 123)  # more than two 16 MiB parts
    (tmp_path / "src").write_bytes(data)
    seen: list[tuple[int, int]] = []
    store.upload_object("ckpt/x.pt", tmp_path / "src", callback=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (len(data), len(data))
    assert store.get_object_size("ckpt/x.pt") == len(data)
    assert store.get_uri("ckpt/x.pt") == f"s3://{bucket}/runs/a/ckpt/x.pt"
    assert store.list_objects("ckpt/") == ["runs/a/ckpt/x.pt"]
    store.download_object("ckpt/x.pt", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data
    with pytest.raises(FileExistsError):
        store.download_object("ckpt/x.pt", tmp_path / "back")
    with pytest.raises(FileNotFoundError, match="runs/a/nothing"):
        store.download_object("nothing", tmp_path / "none")
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    store.delete_object("ckpt/x.pt")
    assert store.list_objects("ckpt/") == []


def test_parse_uri_and_other_schemes() -> None:
    assert parse_uri("s3://b/x/y") == ("s3", "b", "x/y")
    assert parse_uri("local/x") == ("", "", "local/x")
    for uri in ("gcs://b/x", "oci://b/x"):
        with pytest.raises(ValueError, match="not supported.*s3://, gs:// or azure://") as e:
            store_for_uri(uri, "save_folder")
        assert "\n" not in str(e.value)
        assert ("write gs:// for Google Cloud Storage" in str(e.value)) == uri.startswith("gcs:")


def test_probe_names_bucket_and_cause(bucket: str, s3_server, monkeypatch: pytest.MonkeyPatch) -> None:
    assert problem(S3ObjectStore(bucket), "x", write=True) is None
    missing = problem(S3ObjectStore("no-such-bucket-here"), "x", write=True)
    assert missing is not None and "'no-such-bucket-here'" in missing and "does not exist" in missing
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    refused = problem(S3ObjectStore(bucket), "x", write=True)
    assert refused is not None and repr(bucket) in refused and "AWS_ACCESS_KEY_ID" in refused
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    gone = problem(S3ObjectStore(bucket, client_config={"retries": {"max_attempts": 1}}), "x", write=True)
    assert gone is not None and repr(bucket) in gone and "S3_ENDPOINT_URL" in gone
    for message in (missing, refused, gone):
        assert "\n" not in message
