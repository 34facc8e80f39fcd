"""One contract for every backend (s3:// on SeaweedFS, gs:// on fake-gcs-server, azure:// on Azurite):
objects in and out whole, listing and deleting, conditional writes and the leases built on them,
the one-line problems found before training, the upload process, and a Trainer that saves to the
bucket, rotates, and autoresumes on a machine without the local files, bit for bit."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lockstep import Trainer
from lockstep.objectstore import BucketStore, store_for_uri
from lockstep.objectstore.lease import LAPSE_S, Lease
from lockstep.objectstore.probe import problem
from lockstep.objectstore.writer import StoreWriter
from tests.helpers import trainer_params
from tests.trainer.common import MLP, loader

pytestmark = pytest.mark.timeout(240)  # 75 s seen on a loaded 2-core machine


def test_the_factory_gives_each_scheme_its_store(remote) -> None:
    store, key = store_for_uri(remote.uri("a/b"), "save_folder")
    assert isinstance(store, BucketStore) and store.scheme in remote.scheme and key == "a/b"
    assert store.get_uri("a/b/c.pt") == f"{remote.uri('a/b/c.pt')}"


def test_objects_go_up_and_down_whole(remote, tmp_path: Path) -> None:
    store = remote.store()
    data = os.urandom((17 << 20) + 123)  # over one part: S3 and Azure send it in parts
    (tmp_path / "big").write_bytes(data)
    store.upload_object("run/big.pt", tmp_path / "big")
    store.upload_bytes("run/pointer", b"run/big.pt")
    store.upload_bytes("other/x", b"x")
    assert store.get_object_size("run/big.pt") == len(data)
    store.download_object("run/big.pt", tmp_path / "down" / "big.pt")
    assert (tmp_path / "down" / "big.pt").read_bytes() == data
    assert store.read_bytes("run/pointer") == b"run/big.pt"
    assert sorted(store.list_objects("run/")) == ["run/big.pt", "run/pointer"]
    with pytest.raises(FileExistsError):
        store.download_object("run/big.pt", tmp_path / "down" / "big.pt")
    for missing in (lambda: store.read_bytes("run/none"), lambda: store.get_object_size("run/none"),
                    lambda: store.download_object("run/none", tmp_path / "none")):
        with pytest.raises(FileNotFoundError):
            missing()
    assert sorted(os.listdir(tmp_path / "down")) == ["big.pt"] and not (tmp_path / "none").exists()
    store.delete_object("run/big.pt")
    store.delete_object("run/big.pt")  # again: nothing there, no error
    assert store.list_objects("run/") == ["run/pointer"]


def test_conditional_writes(remote) -> None:
    store = remote.store()
    assert store.read_versioned("lease") is None
    first = store.put_if("lease", b"one", token=None)
    assert first is not None
    assert store.put_if("lease", b"two", token=None) is None  # exists: not created again
    found = store.read_versioned("lease")
    assert found is not None and found.data == b"one" and found.token == first and -2 <= found.age_s < 10
    second = store.put_if("lease", b"three", token=first)
    assert second is not None and second != first and store.read_bytes("lease") == b"three"
    assert store.put_if("lease", b"four", token=first) is None  # a stale version: refused
    assert store.read_bytes("lease") == b"three"
    store.delete_object("lease")
    assert store.put_if("lease", b"five", token=second) is None  # gone: nothing to replace


def test_a_lease_is_held_renewed_released_and_taken_over_once_it_lapses(remote) -> None:
    store = remote.store().quick()
    holder = Lease(store, "job/.lease", {"host": "a", "pid": 1})
    assert holder.acquire() is None
    refused = Lease(store, "job/.lease", {"host": "b", "pid": 2}).acquire(deadline_s=3)
    assert refused is not None and refused.get("host") == "a"  # renewed while watched: alive
    holder.release()
    assert store.read_versioned("job/.lease") is None
    dead = Lease(store, "job/.lease", {"host": "c", "pid": 3})
    assert dead.acquire() is None
    lost: list[dict] = []
    dead.on_lost = lost.append
    dead._stop.set()  # killed: no more renewals, nothing deleted
    started = time.monotonic()
    taker = Lease(store, "job/.lease", {"host": "d", "pid": 4})
    assert taker.acquire() is None
    assert time.monotonic() - started < LAPSE_S + 4
    assert store.read_versioned("job/.lease") is not None
    taker.release()


def test_problems_are_one_line_and_name_the_bucket(remote, monkeypatch: pytest.MonkeyPatch) -> None:
    assert problem(remote.store(), "x", write=True) is None
    from lockstep.objectstore.uri import store_of

    missing = problem(store_of(remote.scheme, "no-such-bucket-here"), "x", write=True)
    assert missing is not None and "'no-such-bucket-here'" in missing and "does not exist" in missing
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    if remote.scheme == "s3":
        monkeypatch.setenv("S3_ENDPOINT_URL", dead)
    elif remote.scheme == "gs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", dead)
    else:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                           remote.env["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[0]
                           + "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;")
    gone = problem(remote.store().quick(), "x", write=True)
    assert gone is not None and repr(remote.bucket) in gone and "does not answer" in gone
    for message in (missing, gone):
        assert "\n" not in message


def _timed_out(scheme: str) -> Exception:
    """The client's own error for a reply that never came, as a store method raises it: inside an
    ObjectStoreTransientError."""
    from lockstep.objectstore.store import ObjectStoreTransientError

    if scheme == "s3":
        import botocore.exceptions
        error: Exception = botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1")
    elif scheme == "gs":
        import requests
        error = requests.exceptions.ReadTimeout("Read timed out. (read timeout=5.0)")
    else:
        from azure.core.exceptions import ServiceResponseError
        error = ServiceResponseError("Read timed out")
    try:
        raise ObjectStoreTransientError(f"{scheme}://b/k: {error}") from error
    except ObjectStoreTransientError as e:
        return e


@pytest.mark.parametrize("scheme", ["s3", "gs", "azure"])
def test_a_timeout_in_the_probes_write_is_said_as_a_silent_endpoint(scheme: str) -> None:
    # the listing may be answered and the write not (a server that stops between the two): the
    # write's error comes through the store's translation, and is said as the listing's would be
    from lockstep.objectstore import azure, gcs, s3_errors
    from lockstep.objectstore.probe import try_a_write

    class Silent:
        """A store whose write times out, as a store method says it."""

        def upload_bytes(self, name: str, data: bytes) -> None:
            raise _timed_out(scheme)

    with pytest.raises(Exception) as raised:
        try_a_write(Silent(), "k")
    error = raised.value
    said = (s3_errors._explained(error, object()) if scheme == "s3" else
            gcs._explained(error, "bucket 'b'") if scheme == "gs" else azure._explained(error, "container 'b'"))
    assert "does not answer" in said, said


def test_an_endpoint_that_takes_connections_and_never_answers_is_said_in_seconds(remote) -> None:
    """A black hole (the server paused): the probe a Trainer runs gives up in seconds, not after
    the client's own timeouts and retries (minutes)."""
    store = remote.store()
    os.kill(remote.server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        found = problem(store, "x", write=True)
        took = time.monotonic() - started
    finally:
        os.kill(remote.server.process.pid, signal.SIGCONT)
    assert found is not None and repr(remote.bucket) in found and "does not answer" in found, found
    assert took < 30, f"{took:.0f} s"


def test_the_upload_process_writes_through_the_same_store(remote, tmp_path: Path) -> None:
    store = remote.store()
    (tmp_path / "f").write_bytes(b"payload")
    writer = StoreWriter(store.bucket, scheme=store.scheme, store_options=store.options(), num_attempts=2,
                         backoff_s=0.01)
    try:
        job = writer.submit([("upload", "w/f", str(tmp_path / "f")), ("put", "w/p", "w/f")])
        assert writer.wait(job, timeout=60)
        assert writer.outcome(job).error is None
        again = writer.submit([("upload_new", "w/f", str(tmp_path / "f"))])
        assert writer.wait(again, timeout=60)
        assert "already exists" in (writer.outcome(again).error or "")
    finally:
        writer.close()
    assert store.read_bytes("w/f") == b"payload" and store.read_bytes("w/p") == b"w/f"


def _trainer(**kwargs) -> Trainer:
    torch.manual_seed(0)
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
                   device="cpu", progress_bar=False, seed=3, **kwargs)


def test_a_trainer_saves_rotates_and_autoresumes_on_a_fresh_disk(remote, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    reference = _trainer(max_duration="8ba")
    reference.fit()
    folder = remote.uri("runs/{run_name}")
    first = _trainer(max_duration="4ba", run_name="r", save_folder=folder, save_interval="1ba",
                     save_num_checkpoints_to_keep=2, autoresume=True)
    first.fit()
    first.close()
    store = remote.store()
    assert sorted(store.list_objects("runs/r/")) == ["runs/r/ep0-ba3-rank0.pt", "runs/r/ep0-ba4-rank0.pt",
                                                     "runs/r/latest-rank0.pt.symlink"]
    assert store.read_bytes("runs/r/latest-rank0.pt.symlink") == b"runs/r/ep0-ba4-rank0.pt"
    staged = tmp_path / ".lockstep" / remote.scheme / remote.bucket / "runs" / "r"
    assert (staged / "ep0-ba4-rank0.pt").read_bytes() == store.read_bytes("runs/r/ep0-ba4-rank0.pt")

    fresh = tmp_path / "fresh"  # another machine: no local files, only the bucket
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    resumed = _trainer(max_duration="8ba", run_name="r", save_folder=folder, save_interval="1ba",
                       save_num_checkpoints_to_keep=2, autoresume=True)
    assert resumed.state.timestamp.batch.value == 4
    resumed.fit()
    resumed.close()
    for k, v in trainer_params(reference).items():
        assert torch.equal(v, trainer_params(resumed)[k]), k
    assert sorted(store.list_objects("runs/r/")) == ["runs/r/ep1-ba7-rank0.pt", "runs/r/ep1-ba8-rank0.pt",
                                                     "runs/r/latest-rank0.pt.symlink"]
    loaded = _trainer(max_duration="8ba", load_path=remote.uri("runs/r/ep1-ba8-rank0.pt"))
    assert loaded.state.timestamp.batch.value == 8


JOB = Path(__file__).resolve().parents[1] / "checkpoint" / "train_job.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["gs", "azure"])
def test_two_ranks_upload_their_shards_and_resume_on_a_fresh_disk(
        scheme: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP ``sharded`` under the launcher: each rank uploads the shards it wrote; a second launch in a
    working directory without the staging folder downloads what its ranks read and ends where an
    uninterrupted run does, bit for bit (s3:// has the same in test_s3_resume.py, with kills)."""
    from tests.launcher.conftest import launch

    server = request.getfixturevalue({"gs": "gcs_server", "azure": "azure_server"}[scheme])
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    bucket = server.create_bucket(f"test-{os.getpid()}-two-ranks-{scheme}")
    folder = f"{scheme}://{bucket}/runs/job"

    def run(cwd: Path, save_folder: str, batches: int) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        result = launch(["-n", "2", str(JOB), "--folder", save_folder, "--out", str(tmp_path / f"{cwd.name}.pt"),
                         "--sharded", "--batches", str(batches)], cwd=cwd, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]

    run(tmp_path / "reference", str(tmp_path / "reference" / "ckpt"), 8)
    run(tmp_path / "first", folder, 4)
    names = {k.split("/")[2] for k in store_for_uri(folder, "save_folder")[0].list_objects("runs/job/")}
    assert names == {"ep0-ba4-rank0.pt", "latest-rank0.pt.symlink"}  # a folder of shards, and the pointer
    run(tmp_path / "second", folder, 8)  # a fresh disk: only the bucket holds the run
    reference, resumed = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("reference", "second"))
    assert reference.keys() == resumed.keys()
    for k in reference:
        assert torch.equal(reference[k], resumed[k]), k
