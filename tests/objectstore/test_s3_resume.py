"""Resume through the bucket under the launcher (2 CPU ranks): a job killed with kill -9 while its
uploads run, then autoresumed in another working directory (no local files), ends with the
uninterrupted job's parameters, bit for bit; and two "nodes" (two launchers, each in a working
directory of its own: no shared disk) save and resume through the bucket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lockstep.objectstore import S3ObjectStore
from tests.checkpoint.test_faults import descendants
from tests.launcher.conftest import launch, wait_gone

JOB = Path(__file__).resolve().parents[1] / "checkpoint" / "train_job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(cwd: Path, folder: str, out: Path, *extra: str, nodes: list[str] | None = None,
        timeout: float = 150) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return launch([*(nodes or ["-n", "2"]), str(JOB), "--folder", folder, "--out", str(out), *BATCHES, *extra],
                  cwd=cwd, timeout=timeout)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


def _wait_for_pointer(store: S3ObjectStore, key: str, procs: list[subprocess.Popen]) -> str:
    """The pointer object ``key`` once the job's first upload wrote it (the job must stay up meanwhile)."""
    deadline = time.monotonic() + 240
    while True:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.stderr.read() if p.stderr and p.poll() is not None else "" for p in procs]
        try:
            return store.read_bytes(key).decode()
        except FileNotFoundError:
            time.sleep(0.05)


BATCHES = ["--batches", "12"]  # saves at batches 4, 8 and 12
KINDS = {"ddp": [], "sharded": ["--sharded"], "local": ["--local"], "zero2": ["--zero", "2"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted job's parameters for a kind (DDP, FSDP sharded or local, DeepSpeed ZeRO-2), saved to
    a local folder; each run once."""
    tmp, found = tmp_path_factory.mktemp("reference"), {}

    def of(kind: str) -> dict[str, torch.Tensor]:
        if kind not in found:
            result = job(tmp / kind, str(tmp / kind / "ckpt"), tmp / f"{kind}.pt", *KINDS[kind])
            assert result.returncode == 0, result.stderr
            found[kind] = torch.load(tmp / f"{kind}.pt", weights_only=True)
        return found[kind]
    return of


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", list(KINDS))
def test_kill_9_during_uploads_then_autoresume_elsewhere_is_exact(reference, bucket: str, tmp_path: Path,
                                                                   kind: str) -> None:
    if kind == "zero2" and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"):
        pytest.importorskip("deepspeed")
    folder, extra = f"s3://{bucket}/runs/job", KINDS[kind]
    store = S3ObjectStore(bucket)
    first = tmp_path / "first"
    first.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", str(JOB), "--folder", folder, "--out",
                             str(tmp_path / "first.pt"), *BATCHES, "--sleep", "0.1", *extra], cwd=first,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        # once the bucket's pointer names a checkpoint, later saves are being written and uploaded
        _wait_for_pointer(store, "runs/job/latest-rank0.pt.symlink", [proc])
    finally:
        targets = [proc.pid, *descendants(proc.pid)]
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=30)
        assert not wait_gone(targets)
    pointer = store.read_bytes("runs/job/latest-rank0.pt.symlink").decode()  # it may have moved on since
    if kind == "local":  # each rank moves its own pointer: as if killed between rank 0's move and rank 1's
        store.delete_object("runs/job/latest-rank1.pt.symlink")
    second = job(tmp_path / "elsewhere", folder, tmp_path / "second.pt", *extra)
    assert second.returncode == 0, second.stderr
    resumed_at = int(pointer.rsplit("-ba", 1)[1].split("-")[0])
    assert resumed_at >= 4 and f"attempt 0 resumed at batch {resumed_at}" in second.stdout, second.stdout
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True), reference(kind))
    assert store.read_bytes("runs/job/latest-rank0.pt.symlink").decode().endswith("-ba12-rank0.pt")


def _two_nodes(cwds: tuple[Path, Path], folder: str, out: Path, *extra: str) -> list[subprocess.Popen]:
    """Two launchers of 2 ranks each (world size 4), each in its own working directory: two nodes
    that share no disk, only the bucket."""
    port = free_port()
    procs = []
    for node, cwd in enumerate(cwds):
        cwd.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "lockstep", "-n", "2", "--world_size", "4", "--node_rank", str(node),
             "--master_addr", "127.0.0.1", "--master_port", str(port), str(JOB), "--folder", folder,
             "--out", str(out), *BATCHES, *extra], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"}))
    return procs


def _kill_all(procs: list[subprocess.Popen]) -> None:
    targets = [pid for p in procs for pid in (p.pid, *descendants(p.pid))]
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.communicate(timeout=30)
    assert not wait_gone(targets)


@pytest.mark.timeout(480)
def test_two_nodes_without_a_shared_disk_resume_through_the_bucket(bucket: str, tmp_path: Path) -> None:
    clean = job(tmp_path / "clean", str(tmp_path / "clean" / "ckpt"), tmp_path / "clean.pt", nodes=["-n", "4"],
                timeout=200)
    assert clean.returncode == 0, clean.stderr
    folder, store = f"s3://{bucket}/nodes/job", S3ObjectStore(bucket)
    procs = _two_nodes((tmp_path / "a0", tmp_path / "a1"), folder, tmp_path / "first.pt", "--sleep", "0.1")
    try:
        _wait_for_pointer(store, "nodes/job/latest-rank0.pt.symlink", procs)
    finally:
        _kill_all(procs)
    pointer = store.read_bytes("nodes/job/latest-rank0.pt.symlink").decode()
    procs = _two_nodes((tmp_path / "b0", tmp_path / "b1"), folder, tmp_path / "second.pt")
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        _kill_all(procs)
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    resumed_at = int(pointer.rsplit("-ba", 1)[1].split("-")[0])
    assert f"attempt 0 resumed at batch {resumed_at}" in outs[0][0], outs[0][0]
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True),
                   torch.load(tmp_path / "clean.pt", weights_only=True))
    # the second node downloaded rank 0's checkpoint for its own ranks: no file came over the network from node 0
    assert (tmp_path / "b1" / ".lockstep" / "s3" / bucket / "nodes" / "job" / pointer.rsplit("/", 1)[1]).exists()
