"""Resume through the bucket under the launcher, with "nodes" that share no disk (two launchers, each
in a working directory of its own, so each with its own local staging folder), in every layout:
a job killed with kill -9 while its uploads run, then autoresumed with one node on a fresh disk,
ends with the uninterrupted job's parameters, bit for bit; and two nodes of two ranks resume on
fresh disks, each node downloading only the parts its ranks read."""

from __future__ import annotations

import importlib.util
import os
import re
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


def job(cwd: Path, folder: str, out: Path, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return launch(["-n", "2", str(JOB), "--folder", folder, "--out", str(out), *BATCHES, *extra],
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
def reference(request, tmp_path_factory):
    """The uninterrupted job's parameters for a kind (DDP, FSDP sharded or local, DeepSpeed ZeRO-2), saved to
    a local folder: one launch trains every kind that the selected tests need, each in turn."""
    tmp, found = tmp_path_factory.mktemp("reference"), {}
    kill_test = test_kill_9_during_uploads_then_autoresume_on_other_nodes_is_exact
    wanted = {item.callspec.params["kind"] for item in request.session.items if getattr(item, "function", None) is kill_test}
    if importlib.util.find_spec("deepspeed") is None:
        wanted.discard("zero2")

    def of(kind: str) -> dict[str, torch.Tensor]:
        if kind not in found:
            kinds, cwd = [k for k in KINDS if k == kind or (k in wanted and k not in found)], tmp / kind
            result = job(cwd, str(cwd / "ckpt"), cwd / "clean.pt", "--layouts", ",".join(kinds))
            assert result.returncode == 0, result.stderr
            found.update({k: torch.load(cwd / f"clean.pt.{k}", weights_only=True) for k in kinds})
        return found[kind]
    return of


def _nodes(cwds: tuple[Path, Path], folder: str, out: Path, *extra: str, per_node: int = 2) -> list[subprocess.Popen]:
    """Two launchers of ``per_node`` ranks each, each in its own working directory: two nodes that
    share no disk, only the bucket."""
    port = free_port()
    procs = []
    for node, cwd in enumerate(cwds):
        cwd.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "lockstep", "-n", str(per_node), "--world_size", str(2 * per_node),
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), str(JOB),
             "--folder", folder, "--out", str(out), *BATCHES, *extra], cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
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


def _finish(procs: list[subprocess.Popen]) -> str:
    """Rank 0's node's stdout, once both nodes ended with exit status 0."""
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        _kill_all(procs)
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    return outs[0][0]


def _skip_without_deepspeed(kind: str) -> None:
    if kind == "zero2" and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED"):
        pytest.importorskip("deepspeed")


def _assert_downloaded_what_its_ranks_read(store: S3ObjectStore, cwd: Path, bucket: str, key: str,
                                           ranks: tuple[int, ...]) -> None:
    """The node in ``cwd`` holds, of the folder checkpoint ``key`` it resumed from, lockstep.pt and
    exactly the parts its ``ranks`` read (as its lockstep.pt records): of the per-rank files (DCP
    shards, DeepSpeed optimizer partitions), its ranks' own and no other."""
    local = cwd / ".lockstep" / "s3" / bucket / key
    present = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    reads = torch.load(local / "lockstep.pt", weights_only=False)["lockstep"]["reads"]
    assert present == {"lockstep.pt"} | {n for r in ranks for n in reads[r]}, (ranks, sorted(present))
    every = {k.rsplit(f"{key}/", 1)[1] for k in store.list_objects(f"{key}/")}
    ranked = {n: int(m[1] or m[2]) for n in every if (m := re.search(r"^__(\d+)_\d+\.distcp$|pp_rank_(\d+)_", n))}
    assert {n for n, r in ranked.items() if r in ranks} <= present  # each rank's own files
    assert not {n for n, r in ranked.items() if r not in ranks} & present  # and no other rank's


def _temp_folders(cwd: Path) -> list[Path]:
    """Checkpoint folders still being written (``.NAME.tmp.PID``) in a node's staging folder."""
    return sorted(p for p in cwd.glob(".lockstep/s3/*/**/.*.tmp.*"))


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", list(KINDS))
def test_kill_9_during_uploads_then_autoresume_on_other_nodes_is_exact(reference, bucket: str, tmp_path: Path,
                                                                       kind: str) -> None:
    """Two nodes of one rank each (no shared disk) are killed with kill -9 while their uploads run;
    the job comes back with node 1 on a fresh disk (and node 0 on its old one, whose copy of a folder
    checkpoint lacks node 1's parts; under DDP on a fresh one too), and ends exact."""
    _skip_without_deepspeed(kind)
    folder, extra = f"s3://{bucket}/runs/job", KINDS[kind]
    store = S3ObjectStore(bucket)
    first = (tmp_path / "a0", tmp_path / "a1")
    procs = _nodes(first, folder, tmp_path / "first.pt", "--sleep", "0.1", *extra, per_node=1)
    try:
        # once the bucket's pointer names a checkpoint, later saves are being written and uploaded
        _wait_for_pointer(store, "runs/job/latest-rank0.pt.symlink", procs)
    finally:
        _kill_all(procs)
    pointer = store.read_bytes("runs/job/latest-rank0.pt.symlink").decode()  # it may have moved on since
    if kind == "local":  # each rank moves its own pointer: as if killed between rank 0's move and rank 1's
        store.delete_object("runs/job/latest-rank1.pt.symlink")
    # a DDP rank 0 on its old disk would send its local file to rank 1 (no bucket): both nodes fresh
    node0 = tmp_path / "b0" if kind == "ddp" else first[0]
    out = _finish(_nodes((node0, tmp_path / "b1"), folder, tmp_path / "second.pt", *extra, per_node=1))
    # node 1 has no local files: both take the bucket's newest complete checkpoint
    assert f"attempt 0 resumed at batch {int(pointer.rsplit('-ba', 1)[1].split('-')[0])}" in out, out
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True), reference(kind))
    assert store.read_bytes("runs/job/latest-rank0.pt.symlink").decode().endswith("-ba12-rank0.pt")
    if kind == "ddp":  # each node downloaded rank 0's file for its own ranks
        for node in ("b0", "b1"):
            assert (tmp_path / node / ".lockstep" / "s3" / bucket / pointer).is_file()
    if kind in ("sharded", "zero2"):  # node 1 downloaded only what rank 1 reads, and left no part behind
        _assert_downloaded_what_its_ranks_read(store, tmp_path / "b1", bucket, pointer, (1,))
        assert not _temp_folders(tmp_path / "b1")


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind, via", [("sharded", "load_path"), ("zero2", "autoresume")])
def test_two_nodes_of_two_without_a_shared_disk_resume_through_the_bucket(bucket: str, tmp_path: Path,
                                                                         kind: str, via: str) -> None:
    """Two nodes of two ranks (world size 4), each in its own working directory, train 8 batches
    through the bucket (saving at batches 4 and 8); two fresh nodes resume from its batch-4
    checkpoint (by autoresume, with the bucket's pointer set back to it; or by load_path, saving to
    another folder) and end with the uninterrupted run's parameters, each node having downloaded
    only the parts its own ranks read."""
    _skip_without_deepspeed(kind)
    folder, store, extra = f"s3://{bucket}/nodes/job", S3ObjectStore(bucket), [*KINDS[kind], "--batches", "8"]
    _finish(_nodes((tmp_path / "a0", tmp_path / "a1"), folder, tmp_path / "clean.pt", *extra))
    assert not _temp_folders(tmp_path / "a1"), "node 1 left its part of a checkpoint folder behind"
    assert store.read_bytes("nodes/job/latest-rank0.pt.symlink").decode().endswith("-ba8-rank0.pt")
    name = next(k.split("/")[2] for k in store.list_objects("nodes/job/") if "-ba4-" in k)
    if via == "autoresume":
        store.upload_bytes("nodes/job/latest-rank0.pt.symlink", f"nodes/job/{name}".encode())
    else:
        folder, extra = f"s3://{bucket}/nodes/again", [*extra, "--load", f"s3://{bucket}/nodes/job/{name}"]
    out = _finish(_nodes((tmp_path / "b0", tmp_path / "b1"), folder, tmp_path / "second.pt", *extra))
    assert "attempt 0 resumed at batch 4" in out, out
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True),
                   torch.load(tmp_path / "clean.pt", weights_only=True))
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        _assert_downloaded_what_its_ranks_read(store, tmp_path / f"b{node}", bucket, f"nodes/job/{name}", ranks)
