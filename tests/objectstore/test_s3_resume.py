"""Resume through the bucket under the launcher, with "nodes" that share no disk (two launchers, each
in a working directory of its own, so each with its own local staging folder), in every layout:
a job killed with kill -9 while its uploads run, then autoresumed with one node on a fresh disk,
ends with the uninterrupted job's parameters, bit for bit; two nodes of two ranks resume on
fresh disks, each node downloading only the parts its ranks read; a job killed before any
checkpoint reached the bucket starts fresh on its partial local copies, with each node's
unfinished files swept; each node checks its own copy of the files every rank reads; and a
single-file copy that only another node holds gives way to the bucket's; a damaged local copy
of the newest checkpoint is set aside and downloaded again from the bucket (and when that download
fails midway, nothing of it is left and an older local checkpoint serves); and a disk's older copy
of the run gives way to the bucket's newer checkpoint; and two hosts whose staging folder is one
shared folder download into it together."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.checkpoint import files, integrity
from lockstep.objectstore import S3ObjectStore
from tests.checkpoint.test_faults import descendants
from tests.helpers import assert_bitwise, free_port, launcher_env, shared_run
from tests.launcher.conftest import launch, wait_gone

JOB = Path(__file__).resolve().parents[1] / "checkpoint" / "train_job.py"


def job(cwd: Path, folder: str, out: Path, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return launch(["-n", "2", str(JOB), "--folder", folder, "--out", str(out), *BATCHES, *extra],
                  cwd=cwd, timeout=timeout)


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


@pytest.fixture
def saved(s3_server, s3_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted one-node job of two ranks per kind (DDP, FSDP sharded and local, and
    DeepSpeed ZeRO-2 where installed), saved at batches 4, 8 and 12 through the bucket: made by one
    launch once for every worker (``shared_run``), it is what the tests set a bucket and a staging
    folder up from (:func:`_restore`) and the parameters they compare with. Each kind's objects
    (keys under ``runs/job/<kind>/``) are kept as files, since each worker has a server of its own."""
    kinds = _kinds(*KINDS)

    def every_kind(cwd: Path) -> dict[str, Any]:
        bucket = s3_server.create_bucket(f"saved-{os.getpid()}")
        result = job(cwd / "node", f"s3://{bucket}/runs/job", cwd / "clean.pt", "--layouts", ",".join(kinds))
        assert result.returncode == 0, result.stderr[-3000:]
        store = S3ObjectStore(bucket)
        for key in store.list_objects("runs/job/"):
            store.download_object(key, cwd / "objects" / key)
        return {"folder": str(cwd), "bucket": bucket,
                "params": {k: torch.load(cwd / f"clean.pt.{k}", weights_only=True) for k in kinds}}
    return shared_run(tmp_path_factory, "s3-resume-saved-" + "-".join(kinds), every_kind)


def _restore(saved: dict[str, Any], kind: str, store: S3ObjectStore, cwd: Path | None = None,
             prefix: str = "runs/job/") -> Path | None:
    """The saved job of ``kind`` put into ``store``'s bucket under ``prefix`` (its pointers naming
    the new keys), and with ``cwd``, into that node's staging folder as the job left it there; the
    staging folder. ``prefix`` ``runs/job/KIND/`` keeps the saved keys, as a launch with
    ``--layouts`` reads them."""
    objects, saved_prefix = Path(saved["folder"]) / "objects" / "runs" / "job" / kind, f"runs/job/{kind}/"
    for path in sorted(p for p in objects.rglob("*") if p.is_file()):
        key = prefix + path.relative_to(objects).as_posix()
        data = path.read_bytes()
        store.upload_bytes(key, data.replace(saved_prefix.encode(), prefix.encode()) if key.endswith(".symlink")
                           else data)
    if cwd is None:
        return None
    staged = cwd / ".lockstep" / "s3" / store.bucket / prefix.rstrip("/")
    shutil.copytree(Path(saved["folder"]) / "node" / ".lockstep" / "s3" / saved["bucket"] / "runs" / "job" / kind,
                    staged, symlinks=True)
    return staged


def _nodes(cwds: tuple[Path, Path], folder: str, out: Path, *extra: str, per_node: int = 2,
           hostnames: tuple[str, str] | None = None) -> list[subprocess.Popen]:
    """Two launchers of ``per_node`` ranks each, each in its own working directory: two nodes that
    share no disk, only the bucket. With ``hostnames``, each launcher runs in a UTS namespace of its
    own under that name (two hosts, even where the working directories are one shared folder)."""
    port = free_port()
    procs = []
    for node, cwd in enumerate(cwds):
        cwd.mkdir(parents=True, exist_ok=True)
        host = [] if hostnames is None else ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                                             hostnames[node]]
        procs.append(subprocess.Popen(
            [*host, sys.executable, "-m", "lockstep", "-n", str(per_node), "--world_size", str(2 * per_node),
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), str(JOB),
             "--folder", folder, "--out", str(out), *BATCHES, *extra], cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=launcher_env(extra)))
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
def test_kill_9_during_uploads_then_autoresume_on_other_nodes_is_exact(saved: dict[str, Any], bucket: str,
                                                                       tmp_path: Path, kind: str) -> None:
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
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True), saved["params"][kind])
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


def _wait_for(path: Path, procs: list[subprocess.Popen]) -> None:
    """Until ``path`` (a symlink, a file) exists; the job must stay up meanwhile."""
    deadline = time.monotonic() + 240
    while not (path.is_symlink() or path.exists()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.stderr.read() if p.stderr and p.poll() is not None else "" for p in procs]
        time.sleep(0.02)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", ["sharded"])  # DeepSpeed ZeRO-2 passes too; one kind keeps the suite short
def test_killed_before_the_bucket_held_a_checkpoint_starts_fresh_and_cleans_every_node(
        saved: dict[str, Any], bucket: str, tmp_path: Path, kind: str) -> None:
    """Two nodes of one rank (no shared disk) are killed once node 0 has published its first
    checkpoint locally and before any checkpoint is complete in the bucket (no pointer there): node
    0's staging folder holds a copy without node 1's parts, node 1's none. Restarted on the same
    disks, the job starts fresh instead of failing on that copy, and ends with the uninterrupted
    run's parameters. What a killed job left half written on node 1, which holds no rank 0 (a
    partial checkpoint folder, files being downloaded), is gone after the start; its published
    files are kept."""
    _skip_without_deepspeed(kind)
    folder, extra, store = f"s3://{bucket}/runs/job", KINDS[kind], S3ObjectStore(bucket)
    disks = (tmp_path / "n0", tmp_path / "n1")
    staged = [disk / ".lockstep" / "s3" / bucket / "runs" / "job" for disk in disks]
    # 2 s from the first save's publish to the second save, which would move the bucket's pointer
    procs = _nodes(disks, folder, tmp_path / "first.pt", "--sleep", "0.5", *extra, per_node=1)
    try:
        _wait_for(staged[0] / "latest-rank0.pt", procs)
    finally:
        _kill_all(procs)
    assert not store.list_objects("runs/job/latest"), "the job was killed too late: the bucket has a checkpoint"
    first = staged[0] / "ep0-ba4-rank0.pt"
    recorded = torch.load(first / "lockstep.pt", weights_only=False)["lockstep"]["parts"]
    node1_parts = [n for n in recorded if re.search(r"^__1_\d+\.distcp$|pp_rank_1_", Path(n).name)]
    assert node1_parts and not any((first / n).exists() for n in node1_parts)  # node 0's copy is partial

    # what a killed job leaves on node 1: its part of a folder being written, downloads under way
    partial = staged[1] / ".ep0-ba8-rank0.pt.tmp.4242"
    (partial / "deepspeed").mkdir(parents=True)
    (partial / "__1_0.distcp").write_bytes(b"x" * 100)
    published = staged[1] / "ep0-ba2-rank0.pt"  # published (as a download of an earlier resume leaves it)
    published.mkdir(parents=True)
    (published / "lockstep.pt").write_bytes(b"kept")
    downloading = [published / f"__1_0.distcp.{'a1' * 16}.tmp", published / f"lockstep.pt.{'b2' * 16}.tmp.9fA0b1C2"]
    for path in downloading:
        path.write_bytes(b"half")

    out = _finish(_nodes(disks, folder, tmp_path / "second.pt", *extra, per_node=1))
    assert "attempt 0 resumed at batch 0" in out, out
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True), saved["params"][kind])
    assert store.read_bytes("runs/job/latest-rank0.pt.symlink").decode().endswith("-ba12-rank0.pt")
    assert not _temp_folders(disks[1]) and not any(p.exists() for p in downloading)
    assert (published / "lockstep.pt").read_bytes() == b"kept"


def _succeed(procs: list[subprocess.Popen]) -> list[tuple[str, str]]:
    """Each node's stdout and stderr, once both ended with exit status 0."""
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        _kill_all(procs)
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    return outs


@pytest.mark.timeout(300)
def test_each_node_checks_its_own_copy_of_the_files_every_rank_reads(saved: dict[str, Any], bucket: str,
                                                                    tmp_path: Path) -> None:
    """Two nodes of one rank, each holding in its staging folder its own copy of what its rank
    reads of a sharded checkpoint (as a resume from the bucket leaves it). Both ranks read DCP's
    .metadata, which one rank alone used to check, on its own node's copy: node 1's copy, damaged
    in transit (one flipped byte), is caught by node 1 before anything loads, naming the file;
    then each node sets its copy aside and downloads the bucket's, and the run ends exact."""
    folder, store = f"s3://{bucket}/runs/job", S3ObjectStore(bucket)
    _restore(saved, "sharded", store)
    key = next(k.rsplit("/", 1)[0] for k in store.list_objects("runs/job/") if k.endswith("-ba4-rank0.pt/lockstep.pt"))
    store.upload_bytes("runs/job/latest-rank0.pt.symlink", key.encode())  # as if the job had stopped after batch 4
    header = store.read_bytes(f"{key}/lockstep.pt")
    meta = torch.load(io.BytesIO(header), weights_only=False)["lockstep"]
    sizes = {name: size for name, (size, _) in meta["parts"].items()}
    assert ".metadata" in meta["reads"][0] and ".metadata" in meta["reads"][1]
    # one shared copy: rank 0 checks .metadata's CRC, rank 1 only its size
    assert ".metadata" not in integrity.assign(sizes, meta, 1, 2)[1]
    for node in (0, 1):
        local = tmp_path / f"n{node}" / ".lockstep" / "s3" / bucket / key
        local.mkdir(parents=True)
        (local / "lockstep.pt").write_bytes(header)
        for name in meta["reads"][node]:
            store.download_object(f"{key}/{name}", local / name)
        (local.parent / "latest-rank0.pt").symlink_to(local.name)
    damaged = tmp_path / "n1" / ".lockstep" / "s3" / bucket / key / ".metadata"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))

    (out, err), _ = _succeed(_nodes((tmp_path / "n0", tmp_path / "n1"), folder, tmp_path / "out.pt", "--sharded",
                                    per_node=1))
    assert "attempt 0 resumed at batch 4" in out, out
    assert re.search(r"autoresume found the local copy of the newest checkpoint damaged \(rank 1: checkpoint \S+ is "
                     r"damaged: \.metadata fails its CRC32 check.*downloaded the bucket's copy", err), err[-3000:]
    assert_bitwise(torch.load(tmp_path / "out.pt", weights_only=True), saved["params"]["sharded"])
    for node in (0, 1):  # each disk held a copy of that checkpoint
        assert (tmp_path / f"n{node}" / ".lockstep" / "s3" / bucket / f"{key}.damaged").is_dir()


@pytest.mark.timeout(300)
def test_a_single_file_copy_on_another_node_gives_way_to_the_bucket(saved: dict[str, Any], bucket: str,
                                                                   tmp_path: Path) -> None:
    """Two nodes of one rank (DDP, single-file checkpoints): node 1 keeps, from an earlier resume,
    its copy of the bucket's batch-4 checkpoint and the local pointer to it; rank 0's node is fresh.
    Autoresume takes the bucket's checkpoint on both nodes (rank 0 has nothing to send) and ends
    with the uninterrupted run's parameters."""
    folder, store = f"s3://{bucket}/runs/job", S3ObjectStore(bucket)
    _restore(saved, "ddp", store)
    name = next(k.split("/")[2] for k in store.list_objects("runs/job/") if "-ba4-" in k)
    store.upload_bytes("runs/job/latest-rank0.pt.symlink", f"runs/job/{name}".encode())
    kept = tmp_path / "b1" / ".lockstep" / "s3" / bucket / "runs" / "job"
    kept.mkdir(parents=True)
    store.download_object(f"runs/job/{name}", kept / name)
    (kept / "latest-rank0.pt").symlink_to(name)
    out = _finish(_nodes((tmp_path / "b0", tmp_path / "b1"), folder, tmp_path / "second.pt", per_node=1))
    assert "attempt 0 resumed at batch 4" in out, out
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True), saved["params"]["ddp"])


def _flip_a_byte(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return bytes(data)


def _stopped_after_batch_8(saved: dict[str, Any], kind: str, store: S3ObjectStore, cwd: Path, *,
                           bucket_too: bool = True) -> tuple[Path, str]:
    """The saved one-node job of two ranks of ``kind`` (checkpoints at batches 4, 8 and 12 in the
    bucket and in the staging folder of the node in ``cwd``, under ``runs/job/KIND/`` as a launch
    with ``--layouts`` saves them), set back as if it had stopped after batch 8: both pointers (the
    bucket's, the staging folder's) name the batch-8 checkpoint, and the local batch-12 one is gone.
    Without ``bucket_too`` only the staging folder is set back (a disk the job left after batch 8,
    while it went on elsewhere). The staging folder and the batch-8 checkpoint's name."""
    prefix = f"runs/job/{kind}/"
    staged = _restore(saved, kind, store, cwd, prefix)
    name = next(p.name for p in staged.glob("*-ba8-rank0.pt"))
    for newer in staged.glob("*-ba12-rank*.pt"):
        files.remove(newer)
    for pointer in staged.glob("latest-rank*.pt"):  # FSDP local: each rank's pointer names its own file
        own = name.replace("-rank0.pt", pointer.name[len("latest"):])
        target = own if (staged / own).exists() else name
        pointer.unlink()
        pointer.symlink_to(target)
        if bucket_too and store.list_objects(f"{prefix}{pointer.name}.symlink"):
            store.upload_bytes(f"{prefix}{pointer.name}.symlink", f"{prefix}{target}".encode())
    if bucket_too:
        assert store.read_bytes(f"{prefix}latest-rank0.pt.symlink").decode() == f"{prefix}{name}"
    return staged, name


def _kinds(*kinds: str) -> list[str]:
    """``kinds``, less DeepSpeed ZeRO-2 where it is not installed (and not required)."""
    missing = importlib.util.find_spec("deepspeed") is None and not os.environ.get("LOCKSTEP_REQUIRE_DEEPSPEED")
    return [kind for kind in kinds if kind != "zero2" or not missing]


def _resumed_each_at(stdout: str, batch: int, kinds: list[str]) -> None:
    """A launch with ``--layouts`` resumed each of its ``kinds`` at ``batch``."""
    assert re.findall(r"attempt 0 resumed at batch \d+", stdout) == [f"attempt 0 resumed at batch {batch}"] * len(kinds), \
        stdout


DAMAGED = {"ddp": "", "sharded": "__1_0.distcp", "local": "",
           "zero2": "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"}
"""The file of each kind's batch-8 checkpoint whose local copy is damaged ("": the single file)."""


@pytest.mark.timeout(400)
def test_a_damaged_local_copy_is_downloaded_again_from_the_bucket(saved: dict[str, Any], bucket: str,
                                                                 tmp_path: Path) -> None:
    """One node of two ranks saves to the bucket through its staging folder, in each kind; as if it
    had stopped after batch 8 (both pointers set back to the batch-8 checkpoint, the local batch-12
    one gone), a byte is flipped in the local copy of a file a rank reads (the single file under
    DDP, rank 1's shard under FSDP sharded, rank 1's own file under FSDP local, rank 1's optimizer
    partition under DeepSpeed ZeRO-2). Autoresume sets that copy aside, downloads the bucket's,
    resumes from batch 8 (not from the local batch-4 one) and ends with the uninterrupted run's
    parameters, saying so once on rank 0. One launch trains every kind in turn (``--layouts``)."""
    kinds, store, cwd = _kinds(*DAMAGED), S3ObjectStore(bucket), tmp_path / "node"
    stopped = {kind: _stopped_after_batch_8(saved, kind, store, cwd) for kind in kinds}
    for kind, (staged, name) in stopped.items():
        if kind == "local":  # rank 1's own file
            _flip_a_byte(staged / name.replace("-rank0.pt", "-rank1.pt"))
        else:
            _flip_a_byte(staged / name / DAMAGED[kind] if DAMAGED[kind] else staged / name)

    again = job(cwd, f"s3://{bucket}/runs/job", tmp_path / "second.pt", "--layouts", ",".join(kinds), timeout=360)
    assert again.returncode == 0, again.stderr[-3000:]
    _resumed_each_at(again.stdout, 8, kinds)
    assert "skipped the newest checkpoint" not in again.stderr
    for kind, (staged, name) in stopped.items():
        assert_bitwise(torch.load(tmp_path / f"second.pt.{kind}", weights_only=True), saved["params"][kind])
        folder = f"s3://{bucket}/runs/job/{kind}"
        said = re.findall(r"autoresume found the local copy of the newest checkpoint damaged \(.*\); set it aside "
                          rf"as \S+/runs/job/{kind}/{re.escape(name)}\.damaged(, \S+\.damaged)*, downloaded the "
                          rf"bucket's copy {folder}/{re.escape(name)}( \(each rank its own file\))? again and "
                          r"resumed from it", again.stderr)
        assert len(said) == 1, (kind, again.stderr[-3000:])
        assert (staged / f"{name}.damaged").exists()
        assert store.read_bytes(f"runs/job/{kind}/latest-rank0.pt.symlink").decode().endswith("-ba12-rank0.pt")


@pytest.mark.timeout(300)
def test_when_the_bucket_cannot_serve_the_newest_either_autoresume_falls_back_to_an_older_local_one(
        saved: dict[str, Any], bucket: str, tmp_path: Path) -> None:
    """As above, in two ways the download again cannot help, in one launch (``--layouts``):
    - DDP: the same byte is flipped in the bucket's copy too. The download does not load either, so
      autoresume falls back to the local batch-4 checkpoint, saying both.
    - FSDP sharded: rank 1's local shard is damaged, and the bucket has lost that shard, so the
      download again fails after rank 0 fetched its own. Autoresume says so once, leaves no folder
      of that download behind, keeps the damaged copy it set aside and falls back to the local
      batch-4 checkpoint.
    Both still end with the uninterrupted run's parameters."""
    store, cwd = S3ObjectStore(bucket), tmp_path / "node"
    ddp_staged, ddp_name = _stopped_after_batch_8(saved, "ddp", store, cwd)
    store.upload_bytes(f"runs/job/ddp/{ddp_name}", _flip_a_byte(ddp_staged / ddp_name))
    staged, name = _stopped_after_batch_8(saved, "sharded", store, cwd)
    flipped = _flip_a_byte(staged / name / "__1_0.distcp")
    store.delete_object(f"runs/job/sharded/{name}/__1_0.distcp")

    again = job(cwd, f"s3://{bucket}/runs/job", tmp_path / "second.pt", "--layouts", "ddp,sharded", timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    _resumed_each_at(again.stdout, 4, ["ddp", "sharded"])
    for kind in ("ddp", "sharded"):
        assert_bitwise(torch.load(tmp_path / f"second.pt.{kind}", weights_only=True), saved["params"][kind])
        skipped = re.findall(r"autoresume skipped the newest checkpoint, which does not load .*; resumed from "
                             rf"\S+/runs/job/{kind}/\S+-ba4-rank0\.pt instead", again.stderr)
        assert len(skipped) == 1, (kind, again.stderr[-3000:])
    assert len(re.findall(rf"the copy downloaded again from s3://{bucket}/runs/job/ddp/{re.escape(ddp_name)} does "
                          r"not load either", again.stderr)) == 1, again.stderr[-3000:]
    said = re.findall(rf"could not download it again from s3://{bucket}/runs/job/sharded \(.*__1_0\.distcp.*\); "
                      r"trying older local checkpoints", again.stderr)
    assert len(said) == 1, again.stderr[-3000:]
    assert not [p.name for p in staged.iterdir() if ".tmp." in p.name]
    # the part-filled download never had the checkpoint's name, so the fallback did not set it aside
    # over the damaged copy
    assert (staged / f"{name}.damaged" / "__1_0.distcp").read_bytes() == flipped


@pytest.mark.timeout(300)
def test_an_older_local_copy_gives_way_to_a_newer_checkpoint_in_the_bucket(saved: dict[str, Any], bucket: str,
                                                                           tmp_path: Path) -> None:
    """The job saved at batches 4, 8 and 12, and this disk's staging folder holds its checkpoints only
    up to batch 8 (the job went on elsewhere): autoresume takes the bucket's batch-12 checkpoint,
    not the older local one that serves every rank. Under DDP, FSDP sharded and FSDP local, in one
    launch (``--layouts``)."""
    kinds, store, cwd = ["ddp", "sharded", "local"], S3ObjectStore(bucket), tmp_path / "node"
    stopped = {kind: _stopped_after_batch_8(saved, kind, store, cwd, bucket_too=False)[0] for kind in kinds}
    for kind in kinds:
        assert store.read_bytes(f"runs/job/{kind}/latest-rank0.pt.symlink").decode().endswith("-ba12-rank0.pt")
    again = job(cwd, f"s3://{bucket}/runs/job", tmp_path / "second.pt", "--layouts", ",".join(kinds), timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    _resumed_each_at(again.stdout, 12, kinds)
    for kind, staged in stopped.items():
        assert_bitwise(torch.load(tmp_path / f"second.pt.{kind}", weights_only=True), saved["params"][kind])
        assert os.readlink(staged / "latest-rank0.pt").endswith("-ba12-rank0.pt")


@pytest.mark.timeout(300)
def test_two_hosts_sharing_one_staging_folder_resume_from_the_bucket(bucket: str, tmp_path: Path) -> None:
    """Two hosts (UTS namespaces of their own names) of one rank each, whose working directory is one
    shared folder, as over a network file system: FSDP sharded saves to the bucket; with the staging
    folder gone, autoresume on both downloads the batch-8 checkpoint, each host its rank's parts,
    into the one folder, and ends with the uninterrupted run's parameters."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root (UTS namespaces)")
    folder, store, shared = f"s3://{bucket}/runs/job", S3ObjectStore(bucket), tmp_path / "nfs"
    hosts = ("lockstep-host-a", "lockstep-host-b")
    _finish(_nodes((shared, shared), folder, tmp_path / "clean.pt", "--sharded", per_node=1, hostnames=hosts))
    staged = shared / ".lockstep" / "s3" / bucket / "runs" / "job"
    name = next(p.name for p in staged.glob("*-ba8-rank0.pt"))
    store.upload_bytes("runs/job/latest-rank0.pt.symlink", f"runs/job/{name}".encode())
    shutil.rmtree(shared / ".lockstep")

    out = _finish(_nodes((shared, shared), folder, tmp_path / "second.pt", "--sharded", per_node=1, hostnames=hosts))
    assert "attempt 0 resumed at batch 8" in out, out
    assert_bitwise(torch.load(tmp_path / "second.pt", weights_only=True),
                   torch.load(tmp_path / "clean.pt", weights_only=True))
    downloaded = staged / name
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in downloaded.iterdir()}
    assert not [p.name for p in staged.iterdir() if ".tmp." in p.name]
