"""A ``save_folder`` in a bucket (``s3://BUCKET/PREFIX``): where its checkpoints are staged on the
local disk, which keys they get, and the uploads that take them there.

Checkpoints are first written and published locally exactly as to a local ``save_folder`` (in
``.lockstep/s3/BUCKET/PREFIX`` under the working directory), then each rank uploads the files it
wrote, on a thread of its own, in parts and in parallel for large files (the client's transfer
manager), each file tried up to ``num_attempts`` times with growing pauses. Files are uploaded from
hard links made as soon as they are published, so that the local rotation may delete a checkpoint
whose upload is still running.

The bucket's latest pointer (``<save_latest_filename>.symlink``, holding the key of the checkpoint,
as Composer's) is moved only once every rank has uploaded every part of a checkpoint: the saver
learns that at the next save's agreement, or at the end of ``fit``, and then asks the pointer's
writer to :meth:`Uploader.publish` it, after which older checkpoints beyond
``save_num_checkpoints_to_keep`` are deleted from the bucket.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lockstep import idle
from lockstep.checkpoint import integrity
from lockstep.objectstore import ObjectStore, S3ObjectStore, parse_uri
from lockstep.objectstore.probe import problem
from lockstep.objectstore.uri import check_uri, is_uri

STAGING_ROOT = os.path.join(".lockstep", "s3")
"""Where checkpoints of a bucket's save_folder are staged: ``STAGING_ROOT/BUCKET/PREFIX``, relative
to the working directory (autoresume looks there before it looks in the bucket)."""
POINTER_SUFFIX = ".symlink"
"""Composer's suffix of a latest pointer object: it holds the key of the checkpoint it names."""
_UPLOADING = ".uploading"
"""In the staging folder: the hard links that uploads read from."""


def local_template(uri_template: str) -> str:
    """The local staging folder (a template, as ``save_folder``) of a bucket's ``save_folder``."""
    _, bucket, key = parse_uri(uri_template)
    return os.path.join(STAGING_ROOT, bucket, key)


def owner_of(file_name: str) -> int:
    """The rank that writes ``file_name`` into a folder checkpoint, and uploads it: the rank whose
    own file it is (:func:`integrity.part_rank`), else rank 0."""
    owner = integrity.part_rank(file_name)
    return 0 if owner is None else owner


@dataclass(frozen=True)
class RemoteFolder:
    """One run's save_folder in a bucket, and its local staging folder."""

    uri: str
    """The save_folder, formatted (``s3://bucket/prefix/run``)."""
    store: S3ObjectStore
    key: str
    """The folder's key prefix in the bucket, without a trailing ``/``."""
    local: Path

    @classmethod
    def of(cls, uri: str, local: Path) -> RemoteFolder:
        bucket, key = check_uri(uri, "save_folder")
        return cls(uri, S3ObjectStore(bucket), key.strip("/"), local)

    def key_of(self, name: str) -> str:
        """The key of ``name`` (a path relative to the folder)."""
        name = name.replace(os.sep, "/")
        return f"{self.key}/{name}" if self.key else name

    def problem(self) -> str | None:
        """Why this process could not write the folder's objects (None: it can), in one line."""
        found = problem(self.store, self.key, write=True)
        return None if found is None else f"save_folder {self.uri!r}: {found}"

    def holds_objects(self) -> str | None:
        """The key of an object already under the folder, if any."""
        found = self.store.list_objects(self.key_of(""))
        return found[0] if found else None


class UploadFailed(RuntimeError):
    """An object that could not be uploaded (or deleted) after every attempt."""


class Uploader:
    """This rank's uploads, one checkpoint after the other, on a thread of its own."""

    def __init__(self, folder: RemoteFolder, rank: int, *, num_attempts: int = 3, backoff_s: float = 0.5) -> None:
        if num_attempts < 1:
            raise ValueError(f"num_attempts must be >= 1, got {num_attempts}")
        self.folder, self.rank, self.num_attempts, self.backoff_s = folder, rank, num_attempts, backoff_s
        # links left by this rank's process of an earlier attempt, killed while it uploaded
        shutil.rmtree(folder.local / _UPLOADING / f"rank{rank}", ignore_errors=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lockstep-upload", initializer=idle.yield_to_training)
        self._jobs: list[Future[None]] = []
        self._lock = threading.Lock()
        self._done: list[str] = []
        self._failure: str | None = None
        self.published: str | None = None
        """The checkpoint the bucket's latest pointer names (set once it is written)."""
        self.timings: list[tuple[int, float]] = []
        """(bytes, seconds) of each file uploaded, for benchmarks."""

    def upload(self, name: str, files: Sequence[tuple[Path, str]]) -> None:
        """Upload ``files`` (each a published local file and its name relative to the folder) as
        this rank's parts of checkpoint ``name``. Hard links are made here (on the caller's thread,
        straight after the files are published); the upload runs on the upload thread."""
        staged = self.folder.local / _UPLOADING / f"rank{self.rank}" / f"{name}.{time.monotonic_ns()}"
        links = []
        try:
            for source, relative in files:
                link = staged / relative
                link.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(source, link)
                except OSError:  # a file system without hard links: a copy, which costs its bytes once more
                    shutil.copyfile(source, link)
                links.append((link, relative))
        except OSError as e:
            shutil.rmtree(staged, ignore_errors=True)
            self._fail(f"could not stage {name} for upload: {e}")
            return
        self._submit(self._upload, name, staged, links)

    def _upload(self, name: str, staged: Path, links: list[tuple[Path, str]]) -> None:
        try:
            for link, relative in links:
                key, started = self.folder.key_of(relative), time.perf_counter()
                self._attempt(f"upload {link.name} to {self.folder.store.get_uri(key)}",
                              lambda: self.folder.store.upload_object(key, link, callback=_idle_thread))
                self.timings.append((link.stat().st_size, time.perf_counter() - started))
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        with self._lock:
            self._done.append(name)

    def publish(self, name: str, target_key: str, pointer_key: str | None, remove: Sequence[str]) -> None:
        """Once every rank's parts of ``name`` are in the bucket: point the bucket's latest pointer
        (``pointer_key``) at ``target_key``, then delete the checkpoints ``remove`` (names relative
        to the folder) from the bucket."""
        self._submit(self._publish, name, target_key, pointer_key, list(remove))

    def _publish(self, name: str, target_key: str, pointer_key: str | None, remove: list[str]) -> None:
        store = self.folder.store
        if pointer_key is not None:
            self._attempt(f"write the latest pointer {store.get_uri(pointer_key)}",
                          lambda: store.upload_bytes(pointer_key, target_key.encode()))
        self.published = name
        for old in remove:
            prefix = self.folder.key_of(old)
            for key in [prefix] + store.list_objects(prefix + "/"):
                self._attempt(f"delete {store.get_uri(key)}", lambda key=key: store.delete_object(key))

    def _attempt(self, what: str, action: Callable[[], None]) -> None:
        for attempt in range(self.num_attempts):
            try:
                action()
                return
            except Exception as e:
                if attempt + 1 == self.num_attempts:
                    raise UploadFailed(f"could not {what} after {self.num_attempts} attempts: "
                                       f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
                time.sleep(self.backoff_s * 2 ** attempt)

    def _submit(self, job: Callable[..., None], *args: object) -> None:
        def run() -> None:
            if self._failure is not None:
                return  # the job fails at the next save anyway; nothing after a lost part is published
            try:
                job(*args)
            except BaseException as e:
                self._fail(str(e) if isinstance(e, UploadFailed) else f"{type(e).__name__}: {e}")
        self._jobs = [j for j in self._jobs if not j.done()] + [self._pool.submit(run)]

    def _fail(self, message: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = message

    def state(self) -> tuple[list[str], str | None]:
        """(checkpoints whose parts from this rank are all in the bucket, the first failure)."""
        with self._lock:
            return list(self._done), self._failure

    def drain(self) -> None:
        """Return once every upload handed over so far has ended."""
        for job in list(self._jobs):
            job.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_idled = threading.local()


def _idle_thread(done: int, total: int) -> None:
    """The upload's progress callback, which runs on the client's transfer threads: the first call
    on each makes it take CPU only where training leaves a core idle (see ``idle``)."""
    if not getattr(_idled, "done", False):
        _idled.done = True
        idle.yield_to_training()


def is_remote(path: object) -> bool:
    """Whether ``path`` (a save_folder or load_path) names a bucket rather than a local folder."""
    return is_uri(path)


def complete(saves: Sequence[int], states: Sequence[list[int] | None]) -> int | None:
    """The newest of ``saves`` whose parts every rank has uploaded (a rank with None uploads nothing)."""
    for save in reversed(saves):
        if all(done is None or save in done for done in states):
            return save
    return None


def object_store_problem(store: ObjectStore, key: str, what: str) -> str | None:
    """Why ``store`` cannot be read at ``key``, in one line naming ``what``; None when it can."""
    found = problem(store, key, write=False)
    return None if found is None else f"{what}: {found}"
