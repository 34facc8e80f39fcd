"""RemoteUploaderDownloader: a logger destination that stores the files handed to
``logger.upload_file`` in a bucket, as Composer's does (the run folder's metrics.jsonl,
TensorBoard events and loss curve among them: see :mod:`lockstep.callbacks.run_folder_uploads`)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lockstep.loggers.logger_destination import LoggerDestination
from lockstep.objectstore import ObjectStore
from lockstep.objectstore.probe import problem
from lockstep.objectstore.store import BucketStore
from lockstep.objectstore.uri import check_uri, parse_uri, store_of
from lockstep.objectstore.writer import Outcome, StoreWriter

if TYPE_CHECKING:
    from lockstep.loggers.logger import Logger
    from lockstep.state import State


class RemoteUploaderDownloader(LoggerDestination):
    """Uploads the files loggers and callbacks hand to ``logger.upload_file(remote_file_name,
    file_path, overwrite=False)`` to ``bucket_uri`` (``s3://BUCKET/PREFIX``, ``gs://...``,
    ``azure://...``), in the background, each tried ``num_attempts`` times with growing pauses. A
    file is copied to ``upload_staging_folder`` when it is handed over, so that it may change
    afterwards.

    The object's name is ``file_path_format_string`` with ``{remote_file_name}``, ``{run_name}``,
    ``{rank}``, ... filled in. Whether the bucket takes writes is checked when the Trainer is built;
    an upload that fails for good raises at the next batch or epoch end, or at the end of ``fit``,
    naming the object. Every rank uploads what it is handed (``rank_zero_only=False``).

    ``backend_kwargs`` go to the scheme's store (:class:`lockstep.objectstore.S3ObjectStore`, ...).
    With ``use_procs`` (the default, as Composer's) the uploads run one after the other in a child
    process, which shares neither the interpreter lock nor the CPU priority of training
    (:class:`~lockstep.objectstore.writer.StoreWriter`); otherwise on ``num_concurrent_uploads``
    threads.
    """

    rank_zero_only = False

    def __init__(self, bucket_uri: str, backend_kwargs: dict[str, Any] | None = None,
                 file_path_format_string: str = "{remote_file_name}", num_concurrent_uploads: int = 1,
                 upload_staging_folder: str | None = None, use_procs: bool = True, num_attempts: int = 3) -> None:
        bucket, prefix = check_uri(bucket_uri, "RemoteUploaderDownloader bucket_uri")
        if num_attempts < 1 or num_concurrent_uploads < 1:
            raise ValueError(f"num_attempts and num_concurrent_uploads must be >= 1, got {num_attempts} and "
                             f"{num_concurrent_uploads}")
        self.bucket_uri, self.file_path_format_string = bucket_uri, file_path_format_string
        self.num_attempts, self.use_procs = num_attempts, use_procs
        self._scheme = parse_uri(bucket_uri)[0].lower()
        self._backend_kwargs = {"bucket": bucket, "prefix": prefix, **(backend_kwargs or {})}
        self._backend: BucketStore | None = None
        self._staging = upload_staging_folder
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        self._num_concurrent_uploads = num_concurrent_uploads
        self._pool: ThreadPoolExecutor | None = None
        self._writer: StoreWriter | None = None
        """The uploads' child process (``use_procs``), started with the first upload."""
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._failures: list[str] = []
        self._queued: set[str] = set()
        self._run_name: str | None = None
        self._closed = False

    @property
    def remote_backend(self) -> ObjectStore:
        """The object store files go to."""
        if self._backend is None:
            self._backend = store_of(self._scheme, **self._backend_kwargs)
        return self._backend

    def can_upload_files(self) -> bool:
        return True

    def init(self, state: State, logger: Logger) -> None:
        """When the Trainer is built: check that the bucket takes writes (one line if not)."""
        self._run_name = state.run_name
        store = self.remote_backend
        found = problem(store, getattr(store, "prefix", ""), write=True)
        if found is not None:
            raise ValueError(f"RemoteUploaderDownloader({self.bucket_uri!r}): {found}")

    def get_uri_for_file(self, remote_file_name: str) -> str:
        """The URI the file handed over as ``remote_file_name`` is uploaded to."""
        return self.remote_backend.get_uri(self._object_name(remote_file_name))

    def _object_name(self, remote_file_name: str) -> str:
        from lockstep.checkpoint.templates import place_values

        values = {**place_values(self._run_name or ""), "remote_file_name": remote_file_name}
        return self.file_path_format_string.format(**values).lstrip("/")

    def upload_file(self, state: State, remote_file_name: str, file_path: pathlib.Path, *, overwrite: bool) -> None:
        if self._run_name is None:
            self._run_name = state.run_name
        name = self._object_name(remote_file_name)
        with self._lock:
            if name in self._queued and not overwrite:
                raise FileExistsError(f"{self.remote_backend.get_uri(name)} was already handed over for upload and "
                                      f"overwrite=False")
            self._queued.add(name)
        copy = pathlib.Path(self._staging_folder(), uuid.uuid4().hex)
        shutil.copy2(file_path, copy)
        if self._closed:  # after close (a callback's last files): upload now
            self._upload(name, copy, overwrite)
            self._raise_failures()
            return
        if self.use_procs:
            with self._lock:
                if self._writer is None:
                    bucket = self._backend_kwargs["bucket"]
                    options = {k: v for k, v in self._backend_kwargs.items() if k != "bucket"}
                    self._writer = StoreWriter(bucket, scheme=self._scheme, store_options=options,
                                               num_attempts=self.num_attempts, stop_at_failure=False)
            self._writer.submit([("upload" if overwrite else "upload_new", name, str(copy))], cleanup=str(copy),
                                then=self._settled)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_concurrent_uploads,
                                                thread_name_prefix="lockstep-remote-uploader")
            future = self._pool.submit(self._upload, name, copy, overwrite)
            self._pending = [f for f in self._pending if not f.done()] + [future]

    def _settled(self, outcome: Outcome) -> None:
        if outcome.error is not None:
            with self._lock:
                self._failures.append(outcome.error)

    def _staging_folder(self) -> str:
        if self._staging is None:
            self._tempdir = tempfile.TemporaryDirectory(prefix="lockstep-uploads-")
            self._staging = self._tempdir.name
        os.makedirs(self._staging, exist_ok=True)
        return self._staging

    def _upload(self, name: str, copy: pathlib.Path, overwrite: bool) -> None:
        store = self.remote_backend
        uri = store.get_uri(name)
        try:
            if not overwrite:
                try:
                    store.get_object_size(name)
                except FileNotFoundError:
                    pass
                else:
                    raise FileExistsError(f"{uri} already exists and overwrite=False")
            for attempt in range(self.num_attempts):
                try:
                    store.upload_object(name, copy)
                    break
                except Exception as e:
                    if attempt + 1 == self.num_attempts:
                        raise RuntimeError(f"could not upload {uri} after {self.num_attempts} attempts: "
                                           f"{type(e).__name__}: {_first_line(e)}") from e
                    time.sleep(0.5 * 2 ** attempt)
        except Exception as e:
            with self._lock:
                self._failures.append(str(e) if isinstance(e, (RuntimeError, FileExistsError)) else
                                      f"{uri}: {type(e).__name__}: {_first_line(e)}")
        finally:
            copy.unlink(missing_ok=True)

    def download_file(self, remote_file_name: str, destination: str, overwrite: bool = False,
                      progress_bar: bool = True) -> None:
        """Download the object ``remote_file_name`` (a name in the bucket, not formatted) to ``destination``."""
        self.remote_backend.download_object(remote_file_name, destination, overwrite=overwrite)

    def wait_for_workers(self) -> None:
        """Return once every upload handed over so far has ended; raise if one failed."""
        with self._lock:
            pending, writer = list(self._pending), self._writer
        for future in pending:
            future.result()
        if writer is not None:
            writer.wait()
        self._raise_failures()

    def _raise_failures(self) -> None:
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            raise RuntimeError(f"RemoteUploaderDownloader: {failures[0]}{more}")

    def batch_end(self, state: State, logger: Logger) -> None:
        self._raise_failures()

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._raise_failures()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.wait_for_workers()

    def close(self, state: State, logger: Logger) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_for_workers()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._writer is not None:
                self._writer.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
