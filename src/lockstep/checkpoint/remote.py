"""A ``save_folder`` in a bucket (``s3://BUCKET/PREFIX``, ``gs://...``, ``azure://...``): where its
checkpoints are staged on the local disk, which keys they get, and the uploads that take them there.

Checkpoints are first written and published locally exactly as to a local ``save_folder`` (in
``.lockstep/SCHEME/BUCKET/PREFIX`` under the working directory), then each rank uploads the files it
wrote, from a child process of its own (see :mod:`lockstep.objectstore.writer`), in parts and in
parallel for large files (the client's transfer manager), each file tried up to ``num_attempts``
times with growing pauses. Files are uploaded from hard links made as soon as they are published,
so that the local rotation may delete a checkpoint whose upload is still running.

The bucket's latest pointer (``<save_latest_filename>.symlink``, holding the key of the checkpoint,
as Composer's) is moved only once every rank has uploaded every part of a checkpoint: the saver
learns that at the next save's agreement, or at the end of ``fit``, and then asks the pointer's
writer to :meth:`Uploader.publish` it, after which older checkpoints beyond
``save_num_checkpoints_to_keep`` are deleted from the bucket (which ones, the bucket's own record
says: :mod:`~lockstep.checkpoint.bucket_rotation`).

A rank hands its upload process one checkpoint at a time. Where saves come faster than uploads
end (training leaves the upload too little CPU, or the link is slow), the others wait, and a
waiting checkpoint that ``save_num_checkpoints_to_keep`` newer ones have overtaken is dropped
unsent: the bucket would delete it as soon as they were up. So the queue, and the disk its hard
links hold, stays bounded.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lockstep.checkpoint import integrity
from lockstep.objectstore import ObjectStore, parse_uri
from lockstep.objectstore.probe import problem
from lockstep.objectstore.store import BucketStore
from lockstep.objectstore.uri import is_uri, store_for_uri
from lockstep.objectstore.writer import Action, Guard, Outcome, StoreWriter

STAGING_ROOT = ".lockstep"
"""Where checkpoints of a bucket's save_folder are staged: ``STAGING_ROOT/SCHEME/BUCKET/PREFIX``,
relative to the working directory (autoresume looks there before it looks in the bucket)."""
POINTER_SUFFIX = ".symlink"
"""Composer's suffix of a latest pointer object: it holds the key of the checkpoint it names."""
LEASE_PREFIX = ".lockstep-lease."
"""The start of the name of a job's lease object in its folder (:mod:`~lockstep.checkpoint.bucket_claim`)."""
_UPLOADING = ".uploading"
"""In the staging folder: the hard links that uploads read from."""


def local_template(uri_template: str) -> str:
    """The local staging folder (a template, as ``save_folder``) of a bucket's ``save_folder``."""
    scheme, bucket, key = parse_uri(uri_template)
    return os.path.join(STAGING_ROOT, scheme, bucket, key)


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
    store: BucketStore
    key: str
    """The folder's key prefix in the bucket, without a trailing ``/``."""
    local: Path

    @classmethod
    def of(cls, uri: str, local: Path) -> RemoteFolder:
        store, key = store_for_uri(uri, "save_folder")
        return cls(uri, store, key.strip("/"), local)

    def key_of(self, name: str) -> str:
        """The key of ``name`` (a path relative to the folder)."""
        name = name.replace(os.sep, "/")
        return f"{self.key}/{name}" if self.key else name

    def problem(self) -> str | None:
        """Why this process could not write the folder's objects (None: it can), in one line."""
        found = problem(self.store, self.key, write=True)
        return None if found is None else f"save_folder {self.uri!r}: {found}"

    def names(self) -> set[str]:
        """The names directly under the folder (a folder checkpoint's objects give its name), leases aside."""
        prefix = self.key_of("")
        return {key[len(prefix):].split("/", 1)[0] for key in self.store.list_objects(prefix) if not is_lease(key)}

    def holds_objects(self) -> str | None:
        """The key of an object already under the folder, if any (jobs' leases aside)."""
        found = [key for key in self.store.list_objects(self.key_of("")) if not is_lease(key)]
        return found[0] if found else None


class Uploader:
    """This rank's uploads, one checkpoint after the other, by a child process of its own
    (:class:`~lockstep.objectstore.writer.StoreWriter`). Create it on the thread that lives as long
    as the process (the child dies with that thread)."""

    def __init__(self, folder: RemoteFolder, rank: int, *, num_attempts: int = 3, backoff_s: float = 0.5,
                 active: bool = True, keep: int = -1) -> None:
        if num_attempts < 1:
            raise ValueError(f"num_attempts must be >= 1, got {num_attempts}")
        self.folder, self.rank = folder, rank
        # links left by this rank's process of an earlier attempt, killed while it uploaded
        shutil.rmtree(folder.local / _UPLOADING / f"rank{rank}", ignore_errors=True)
        store = folder.store
        self._writer = StoreWriter(store.bucket, scheme=store.scheme, store_options=store.options(),
                                   num_attempts=num_attempts, backoff_s=backoff_s) if active else None
        """The upload process; None on a rank that uploads nothing (``active=False``: DDP's ranks but
        rank 0), which then starts none."""
        self.keep = keep
        """How many of the newest checkpoints the bucket keeps (0 or -1: every one)."""
        self._lock = threading.Condition()
        self._waiting: list[tuple[str, list[Action], Path]] = []
        """Checkpoints not yet handed to the upload process, oldest first: name, uploads, their links."""
        self._sending = False
        """Whether the upload process has a checkpoint of this uploader's that has not ended."""
        self.dropped: list[str] = []
        """Checkpoints never sent: newer ones overtook them while they waited."""
        self._done: list[str] = []
        self._failure: str | None = None
        self.published: str | None = None
        """The checkpoint the bucket's latest pointer names (set once it is written)."""
        self.timings: list[tuple[int, float]] = []
        """(bytes, seconds) of each file uploaded, for benchmarks."""
        self.guard: Guard | None = None
        """The run's lease on the folder, read before each write (None: writes are not guarded)."""

    def upload(self, name: str, files: Sequence[tuple[Path, str]]) -> None:
        """Upload ``files`` (each a published local file and its name relative to the folder) as
        this rank's parts of checkpoint ``name``. Hard links are made here (on the caller's thread,
        straight after the files are published); the child process uploads from them."""
        staged = self.folder.local / _UPLOADING / f"rank{self.rank}" / f"{name}.{time.monotonic_ns()}"
        links: list[Action] = []
        try:
            for source, relative in files:
                link = staged / relative
                link.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(source, link)
                except OSError:  # a file system without hard links: a copy, which costs its bytes once more
                    shutil.copyfile(source, link)
                links.append(("upload", self.folder.key_of(relative), str(link.resolve())))
        except OSError as e:
            shutil.rmtree(staged, ignore_errors=True)
            self.fail(f"could not stage {name} for upload: {e}")
            return
        self._started()
        with self._lock:
            self._waiting.append((name, links, staged))
            newest = {n for n, _, _ in self._waiting[-self.keep:]} if self.keep > 0 else None
        if newest is not None:
            self._drop_waiting(lambda waiting: waiting not in newest)
        self._send_next()

    def _drop_waiting(self, which: Callable[[str], bool]) -> None:
        """Drop the waiting checkpoints ``which`` names, with their links: they are never sent."""
        with self._lock:
            gone = [w for w in self._waiting if which(w[0])]
            self._waiting = [w for w in self._waiting if not which(w[0])]
            self.dropped.extend(name for name, _, _ in gone)
        for _, _, staged in gone:
            shutil.rmtree(staged, ignore_errors=True)

    def _send_next(self) -> None:
        """Hand the oldest waiting checkpoint to the upload process, unless one is under way there.
        The submit comes after this lock is let go: the upload process's answers take its own lock first."""
        with self._lock:
            if self._sending or not self._waiting:
                return
            name, links, staged = self._waiting.pop(0)
            self._sending = True
        assert self._writer is not None
        self._writer.submit(links, cleanup=str(staged.resolve()), guard=self.guard,
                            then=lambda outcome: self._uploaded(name, outcome))

    def _uploaded(self, name: str, outcome: Outcome) -> None:
        unsent: list[tuple[str, list[Action], Path]] = []
        with self._lock:
            self.timings.extend(outcome.timings)
            if outcome.error is None and not outcome.skipped:
                self._done.append(name)
            else:  # what waits behind a failed upload is not sent (the job fails at its next save)
                unsent, self._waiting = self._waiting, []
            self._sending = False
            self._lock.notify_all()
        for _, _, staged in unsent:
            shutil.rmtree(staged, ignore_errors=True)
        if outcome.error is not None:
            self.fail(outcome.error)
        self._send_next()

    def publish(self, name: str, target_key: str, pointer_key: str | None, remove: Sequence[str]) -> None:
        """Once every rank's parts of ``name`` are in the bucket: point the bucket's latest pointer
        (``pointer_key``) at ``target_key``, then delete the checkpoints ``remove`` (names relative
        to the folder) from the bucket."""
        if pointer_key is not None:
            self._started().submit([("put", pointer_key, target_key)], guard=self.guard,
                                   then=lambda outcome: self._pointed(name, outcome))
        else:
            self.published = name
        if remove:
            # one still waiting here would otherwise be sent after its deletion, and stay
            self._drop_waiting(lambda waiting: waiting in remove)
            self._started().submit([("delete_tree", self.folder.key_of(old)) for old in remove], guard=self.guard,
                                   then=self._settled)

    def _pointed(self, name: str, outcome: Outcome) -> None:
        if outcome.error is None and not outcome.skipped:
            self.published = name
        self._settled(outcome)

    def _settled(self, outcome: Outcome) -> None:
        if outcome.error is not None:
            self.fail(outcome.error)

    def fail(self, message: str) -> None:
        """Fail the job at the next save or the end of ``fit`` with ``message`` (the first such one)."""
        with self._lock:
            if self._failure is None:
                self._failure = message

    def state(self) -> tuple[list[str], str | None]:
        """(checkpoints whose parts from this rank are all in the bucket, the first failure)."""
        with self._lock:
            return list(self._done), self._failure

    def drain(self) -> None:
        """Return once every upload handed over so far has ended."""
        if self._writer is not None:
            with self._lock:
                self._lock.wait_for(lambda: not (self._sending or self._waiting))
            self._writer.wait()

    def close(self) -> None:
        """End the upload process once it has done what it was given."""
        if self._writer is not None:
            self._writer.close()

    def _started(self) -> StoreWriter:
        if self._writer is None:
            raise RuntimeError(f"rank {self.rank} was not meant to upload to {self.folder.uri} "
                               f"(Uploader(active=False))")
        return self._writer


def is_lease(key: str) -> bool:
    """Whether the object ``key`` is a job's lease on its folder (:mod:`~lockstep.checkpoint.bucket_claim`)."""
    return key.rsplit("/", 1)[-1].startswith(LEASE_PREFIX)


def error_line(error: BaseException) -> str:
    """An error's first line (its type's name when it says nothing), for one-line messages."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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
