"""One job at a time writes a save folder in a bucket, across machines: leases on the real server
(exclusive, renewed, released, taken over once lapsed, and their loss told to their holder), and
Trainers of other processes, each in a working directory of its own (so sharing no staging folder,
as jobs on two machines), refused while a live job holds the folder; and a job whose lease another
took over fails at its next save, and writes nothing more to the bucket; claimers take turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lockstep import Callback, Trainer
from lockstep.checkpoint import bucket_claim
from lockstep.checkpoint.remote import RemoteFolder, Uploader
from lockstep.objectstore import S3ObjectStore
from lockstep.objectstore.lease import LAPSE_S, RENEW_S, Lease, client_for_leases
from tests.launcher.conftest import launch
from tests.trainer.common import MLP, loader

pytestmark = pytest.mark.timeout(240)  # 82 s seen on a loaded 2-core machine
ROOT = Path(__file__).resolve().parents[2]

CLAIMER = """
import sys, torch
from lockstep import Callback, Trainer
from tests.trainer.common import MLP, loader
model = MLP()
try:
    trainer = Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                      device="cpu", progress_bar=False, max_duration="2ba", run_name=sys.argv[2],
                      save_folder=sys.argv[1], save_interval="1ba", autoresume=True)
except ValueError as e:
    print("REFUSED", e, flush=True)
    sys.exit(3)
trainer.fit()
trainer.close()
print("TRAINED", flush=True)
"""


def _claimer(cwd: Path, folder: str, run_name: str) -> subprocess.CompletedProcess:
    """Another process (another machine: its own working directory) that builds a Trainer saving to
    ``folder`` and trains 2 batches."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CLAIMER, folder, run_name], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=90)


def _fit_that_fails(bucket: str, max_duration: str, callback: Callback) -> tuple[Trainer, str]:
    """Run ``job`` saving to s3://bucket/runs/job every 2 batches with ``callback``; its fit must
    raise a RuntimeError, whose message is returned with the (closed) Trainer."""
    torch.manual_seed(0)
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                      device="cpu", progress_bar=False, max_duration=max_duration, run_name="job",
                      save_folder=f"s3://{bucket}/runs/job", save_interval="2ba", callbacks=[callback])
    try:
        with pytest.raises(RuntimeError) as e:
            trainer.fit()
    finally:
        trainer.close()
    return trainer, str(e.value)


def test_a_lease_is_exclusive_while_renewed_and_free_once_released(bucket: str) -> None:
    store = S3ObjectStore(bucket)
    first = Lease(store, "runs/a/.lease", {"run_name": "a", "pid": 1, "host": "one"})
    assert first.acquire() is None
    try:
        started = time.monotonic()
        holder = Lease(store, "runs/a/.lease", {"run_name": "a", "pid": 2, "host": "two"}).acquire()
        waited = time.monotonic() - started
        assert holder is not None and holder["pid"] == 1 and holder["host"] == "one"
        assert waited < RENEW_S + 3, "a renewal seen while watching refuses at once"
        time.sleep(LAPSE_S + 1)  # still renewed: never lapses
        assert Lease(store, "runs/a/.lease", {"pid": 3}).acquire() is not None
    finally:
        first.release()
    assert store.list_objects("runs/a/") == []
    second = Lease(store, "runs/a/.lease", {"pid": 4})
    started = time.monotonic()
    assert second.acquire() is None
    assert time.monotonic() - started < 1
    second.release()


def test_a_lapsed_lease_is_taken_over_within_the_lapse(bucket: str) -> None:
    """A lease no holder renews any more (its job killed) is taken over once it lapses, and no later."""
    store = S3ObjectStore(bucket)
    store.upload_bytes("runs/b/.lease", json.dumps({"run_name": "b", "pid": 7, "host": "gone"}).encode())
    written = time.monotonic()
    lease = Lease(store, "runs/b/.lease", {"run_name": "b", "pid": 8})
    try:
        assert lease.acquire() is None
        took = time.monotonic() - written
        assert LAPSE_S - 1.5 <= took <= LAPSE_S + 2.5, took  # the server's clock counts whole seconds
        assert json.loads(store.read_bytes("runs/b/.lease"))["pid"] == 8
    finally:
        lease.release()


def test_a_holder_whose_lease_was_taken_over_is_told_who_took_it(bucket: str) -> None:
    store = S3ObjectStore(bucket)
    told: list[dict] = []
    event = threading.Event()
    lease = Lease(store, "runs/c/.lease", {"run_name": "c", "pid": 1},
                  on_lost=lambda holder: (told.append(holder), event.set()))
    assert lease.acquire() is None
    store.upload_bytes("runs/c/.lease", json.dumps({"run_name": "c", "pid": 99, "host": "elsewhere"}).encode())
    assert event.wait(RENEW_S + 5)
    assert told == [{"run_name": "c", "pid": 99, "host": "elsewhere"}]
    lease.release()  # not its lease any more: left alone
    assert json.loads(store.read_bytes("runs/c/.lease"))["pid"] == 99


def test_a_job_on_another_machine_is_refused_while_a_live_job_holds_the_folder(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Trainer built here holds s3://.../runs/job: another process of the same run, and one of
    another run that writes the same names, are refused in one line naming this process; once this
    one has trained, the same job runs (and autoresumes from its checkpoint)."""
    monkeypatch.chdir(tmp_path)
    folder = f"s3://{bucket}/runs/job"
    torch.manual_seed(0)
    model = MLP()
    holder = Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                     device="cpu", progress_bar=False, max_duration="2ba", run_name="job", save_folder=folder,
                     save_interval="1ba")
    try:
        same = _claimer(tmp_path / "other-machine", folder, "job")
        assert same.returncode == 3, same.stdout + same.stderr[-2000:]
        line = same.stdout.strip()
        assert len(line.splitlines()) == 1
        assert f"run 'job' is already running with save_folder {folder} (pid {os.getpid()} on " in line, line
        assert "stop that job first, or give this one another run_name or save_folder" in line
        other = _claimer(tmp_path / "third-machine", folder, "other")
        assert other.returncode == 3, other.stdout + other.stderr[-2000:]
        assert f"save_folder {folder} is in use by run 'job' (pid {os.getpid()} on " in other.stdout, other.stdout
        holder.fit()  # the end of fit gives the folder up
    finally:
        holder.close()
    again = _claimer(tmp_path / "other-machine", folder, "job")
    assert again.returncode == 0 and "TRAINED" in again.stdout, again.stdout + again.stderr[-2000:]
    assert not [k for k in S3ObjectStore(bucket).list_objects("runs/job/") if ".lockstep-lease." in k]


def test_a_job_whose_lease_was_taken_over_fails_at_its_next_save(bucket: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """After batch 1, another job's record replaces this job's lease (as when a job takes over a
    lease that this one failed to renew): the renewal finds it, and the next save fails the job in
    one line naming the other job."""
    monkeypatch.chdir(tmp_path)
    store = S3ObjectStore(bucket)

    class TakeOver(Callback):
        def __init__(self) -> None:
            self.batches = 0

        def batch_end(self, state, logger) -> None:
            self.batches += 1
            if self.batches == 1:
                store.upload_bytes("runs/job/.lockstep-lease.job",
                                   json.dumps({"run_name": "job", "pid": 4242, "host": "node-3"}).encode())
                time.sleep(RENEW_S + 2)  # a renewal meets it

    trainer, message = _fit_that_fails(bucket, "4ba", TakeOver())
    assert f"another job of run 'job' (pid 4242 on node-3) took save_folder s3://{bucket}/runs/job over" in message
    assert "\n" not in message
    assert trainer.state.timestamp.batch.value in (2, 4)
    assert json.loads(store.read_bytes("runs/job/.lockstep-lease.job"))["pid"] == 4242  # left to its holder


def test_a_displaced_uploaders_writes_stop_once_another_holds_the_lease(bucket: str, tmp_path: Path) -> None:
    """An uploader guarded by its run's lease writes while the lease is its holder's (or gone);
    once another job's record is there, its queued upload, pointer move and deletion do not land,
    and its failure names the other job."""
    folder = RemoteFolder.of(f"s3://{bucket}/runs/fence", tmp_path / "staging")
    store, lease = folder.store, folder.key_of(".lockstep-lease.fence")
    pointer = folder.key_of("latest-rank0.pt.symlink")
    for name in ("ck1", "ck2"):
        (tmp_path / name).write_bytes(name.encode() * 1000)
    store.upload_bytes(lease, json.dumps({"holder": "mine", "pid": 1, "host": "here"}).encode())
    uploader = Uploader(folder, 0)
    uploader.guard = (lease, "mine")
    try:
        uploader.upload("ck1", [(tmp_path / "ck1", "ck1")])
        uploader.drain()
        uploader.publish("ck1", folder.key_of("ck1"), pointer, [])
        uploader.drain()
        assert store.read_bytes(pointer).decode() == folder.key_of("ck1")
        store.upload_bytes(lease, json.dumps({"holder": "theirs", "pid": 4242, "host": "node-3"}).encode())
        uploader.upload("ck2", [(tmp_path / "ck2", "ck2")])
        uploader.publish("ck2", folder.key_of("ck2"), pointer, ["ck1"])
        uploader.drain()
        _, failure = uploader.state()
    finally:
        uploader.close()
    assert failure is not None and "\n" not in failure
    assert (f"did not upload ck2 to s3://{bucket}/runs/fence/ck2: another job (pid 4242 on node-3) holds "
            f"s3://{bucket}/{lease} now") in failure, failure
    assert store.read_bytes(pointer).decode() == folder.key_of("ck1")
    assert sorted(store.list_objects("runs/fence/")) == sorted([folder.key_of("ck1"), pointer, lease])
    jobs = [("a pointer move", pointer, [], f"did not write s3://{bucket}/{pointer}"),
            ("a deletion", None, ["ck1"], f"did not delete s3://{bucket}/runs/fence/ck1")]
    for name, pointer_key, remove, refused in jobs:
        alone = Uploader(folder, 0)  # each job alone: no earlier failure skips it
        alone.guard = (lease, "mine")
        try:
            alone.publish("ck2", folder.key_of("ck2"), pointer_key, remove)
            alone.drain()
            _, failure = alone.state()
        finally:
            alone.close()
        assert failure is not None and refused in failure, (name, failure)
    assert store.read_bytes(pointer).decode() == folder.key_of("ck1")
    assert sorted(store.list_objects("runs/fence/")) == sorted([folder.key_of("ck1"), pointer, lease])
    store.delete_object(lease)  # released by its holder: nobody else's to respect
    again = Uploader(folder, 0)
    again.guard = (lease, "mine")
    try:
        again.upload("ck2", [(tmp_path / "ck2", "ck2")])
        again.drain()
        assert again.state() == (["ck2"], None)
    finally:
        again.close()


def test_a_save_right_after_another_job_took_the_lease_does_not_reach_the_bucket(
        bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another job's record replaces the lease just before the save of batch 2, sooner than a
    renewal can notice: that checkpoint never lands, and the job fails by the end of ``fit``."""
    monkeypatch.chdir(tmp_path)
    store = S3ObjectStore(bucket)

    class TakeOverBeforeSave(Callback):
        def batch_end(self, state, logger) -> None:
            if state.timestamp.batch.value == 2:
                store.upload_bytes("runs/job/.lockstep-lease.job",
                                   json.dumps({"run_name": "job", "pid": 4242, "host": "node-3"}).encode())

    _, message = _fit_that_fails(bucket, "2ba", TakeOverBeforeSave())
    assert "pid 4242 on node-3" in message and "\n" not in message, message
    assert store.list_objects("runs/job/") == ["runs/job/.lockstep-lease.job"]
    assert (tmp_path / ".lockstep/s3" / bucket / "runs/job/ep0-ba2-rank0.pt").exists()  # kept on the disk


SHARDED_TAKEN_OVER = """
import json, sys, torch
from lockstep import Callback, Trainer, dist
from lockstep.objectstore import S3ObjectStore
from tests.trainer.common import MLP, loader

class TakeOverBeforeSave(Callback):
    def batch_end(self, state, logger):
        if state.timestamp.batch.value == 2 and dist.get_global_rank() == 0:
            S3ObjectStore(sys.argv[1]).upload_bytes(
                "runs/job/.lockstep-lease.job", json.dumps({"run_name": "job", "pid": 4242, "host": "node-3"}).encode())
        dist.barrier()  # every rank's save comes after the other job's record

model = MLP()
trainer = Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                  device="cpu", progress_bar=False, max_duration="2ba", run_name="job",
                  save_folder=f"s3://{sys.argv[1]}/runs/job", save_interval="2ba",
                  fsdp_config={"state_dict_type": "sharded"}, callbacks=[TakeOverBeforeSave()])
try:
    trainer.fit()
except RuntimeError as e:
    print(f"FAILED rank {dist.get_global_rank()}: {e}", flush=True)
    sys.exit(3)
"""


def test_every_ranks_uploads_stop_once_another_job_holds_the_lease(bucket: str, tmp_path: Path) -> None:
    """FSDP sharded: each rank uploads its own shards, guarded by rank 0's holder. Another job's
    record replaces the lease just before the save: no rank's part of it reaches the bucket."""
    script = tmp_path / "job.py"
    script.write_text(SHARDED_TAKEN_OVER)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    result = launch(["-n", "2", str(script), bucket], cwd=tmp_path, timeout=100, env=env)
    assert result.returncode != 0, result.stdout + result.stderr[-2000:]
    assert "pid 4242 on node-3" in result.stdout, result.stdout + result.stderr[-2000:]
    assert S3ObjectStore(bucket).list_objects("runs/job/") == ["runs/job/.lockstep-lease.job"]
    shards = sorted(p.name for p in (tmp_path / ".lockstep/s3" / bucket / "runs/job").rglob("*.distcp"))
    assert len(shards) == 2, shards  # both ranks saved their part: the guard, not the save, kept them out


def test_claims_of_a_folder_take_turns(bucket: str, tmp_path: Path) -> None:
    """A claimer waits while another holds the folder's claiming turn; a lease that other run took
    meanwhile, with names that clash, refuses it once its turn comes (looking first and taking
    after, as without turns, it would have found the folder free)."""
    folder = RemoteFolder.of(f"s3://{bucket}/runs/shared", tmp_path)
    store = client_for_leases(folder.store)
    busy = Lease(store, folder.key_of(bucket_claim.CLAIMING), {"pid": 2, "host": "node-9", "claiming": "a"})
    assert busy.acquire() is None
    result: dict[str, str | None] = {}
    claimer = threading.Thread(target=lambda: result.update(
        error=bucket_claim.claim(folder, "b", ["ep*-ba*-rank0.pt"], lambda message: None)))
    try:
        claimer.start()
        time.sleep(2 * RENEW_S + 1)
        assert claimer.is_alive() and not result, "a claim waits for its turn"
        store.upload_bytes(folder.key_of(".lockstep-lease.a"), json.dumps(
            {"run_name": "a", "pid": 2, "host": "node-9", "patterns": ["ep*-ba*-rank0.pt"]}).encode())
    finally:
        busy.release()
    claimer.join(30)
    assert not claimer.is_alive()
    error = result["error"]
    assert error is not None and f"save_folder {folder.uri} is in use by run 'a' (pid 2 on node-9)" in error, error
    assert sorted(store.list_objects("runs/shared/")) == [folder.key_of(".lockstep-lease.a")]


def test_a_run_whose_name_makes_the_same_lease_name_as_a_live_runs_is_refused(bucket: str, tmp_path: Path) -> None:
    folder = RemoteFolder.of(f"s3://{bucket}/runs/alike", tmp_path)
    other = Lease(client_for_leases(folder.store), folder.key_of(".lockstep-lease.exp_1"),
                  {"run_name": "exp/1", "pid": 5, "host": "node-5", "patterns": ["exp/1-*.pt"]})
    assert other.acquire() is None
    try:
        error = bucket_claim.claim(folder, "exp:1", ["exp:1-*.pt"], lambda message: None)
    finally:
        other.release()
    assert error == (f"save_folder {folder.uri} is in use by run 'exp/1' (pid 5 on node-5), whose lease there has "
                     f"the name this run's would have (.lockstep-lease.exp_1): give this run a name that differs "
                     f"in a letter or digit")


def test_a_run_cut_off_long_enough_for_another_run_to_claim_learns_it_lost_the_folder(
        bucket: str, tmp_path: Path) -> None:
    """Run a's lease goes unrenewed past the lapse (its job cut off from the bucket, not dead); run
    b, whose names clash, claims the folder and supersedes that lease; when a renews again it is
    told that run b took the folder, and a's writers, guarded by its lease, stop."""
    folder = RemoteFolder.of(f"s3://{bucket}/runs/cut", tmp_path)
    store = client_for_leases(folder.store)
    key = folder.key_of(".lockstep-lease.a")
    told: list[dict] = []
    event = threading.Event()
    a = Lease(store, key, {"run_name": "a", "pid": 3, "host": "node-3", "patterns": ["ep*-ba*-rank0.pt"]},
              on_lost=lambda holder: (told.append(holder), event.set()))
    assert a.acquire() is None
    a._stop.set()  # cut off: no renewals for a while
    a._thread.join()
    time.sleep(LAPSE_S + 1.5)
    lost: list[str] = []
    assert bucket_claim.claim(folder, "b", ["ep*-ba*-rank0.pt"], lost.append) is None
    try:
        a._start_renewing()  # back in reach
        assert event.wait(RENEW_S + 5)
        assert told[0]["run_name"] == "b" and told[0]["superseded"] == "a"
        assert json.loads(store.read_bytes(key))["holder"] != a.record["holder"]
    finally:
        a.release()
        bucket_claim.release(folder, "b", lost.append)
    assert lost == []
