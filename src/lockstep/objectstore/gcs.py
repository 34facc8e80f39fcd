"""A Google Cloud Storage bucket through Google's own client (``google-cloud-storage``), as
Composer's ``GCSObjectStore`` (``gs://BUCKET/PREFIX``).

Credentials come from Google's default chain (``GOOGLE_APPLICATION_CREDENTIALS``, the metadata
server, ``gcloud auth application-default login``) unless given; an emulator's endpoint from
``STORAGE_EMULATOR_HOST`` (fake-gcs-server), where the client needs no credentials. Files go up as
resumable uploads in chunks of :data:`PART_BYTES`; a version token is the object's generation,
which ``ifGenerationMatch`` conditions a write on (0: the object must not exist).
"""

from __future__ import annotations

import datetime
import email.utils
import os
import pathlib
from collections.abc import Callable
from typing import Any

from lockstep.objectstore.probe import first_line, try_a_write
from lockstep.objectstore.store import ObjectStoreTransientError, Versioned, whole_file

GCS_INSTALL_HINT = "pip install 'torch-lockstep[gcs]' (google-cloud-storage)"
PART_BYTES = 16 << 20
"""A resumable upload sends the file in chunks of this size."""
_CREDENTIALS = ("set GOOGLE_APPLICATION_CREDENTIALS to a service account key this bucket accepts (or run "
                "`gcloud auth application-default login`)")


class GCSObjectStore:
    """Objects in the GCS ``bucket`` under ``prefix``. ``project`` and ``credentials`` (a
    ``google.auth`` credentials object) default to Google's chain; ``client_options`` go to the
    client (e.g. ``{"api_endpoint": ...}``), ``timeout_s`` bounds each request."""

    scheme = "gs"

    def __init__(self, bucket: str, prefix: str = "", project: str | None = None, credentials: Any = None,
                 client_options: dict[str, Any] | None = None, timeout_s: float = 60.0,
                 retry: bool = True) -> None:
        try:
            from google.cloud import storage
        except ImportError as e:
            raise ImportError(f"GCS object stores need google-cloud-storage: {GCS_INSTALL_HINT}") from e
        self.bucket = bucket.strip("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._options = {"prefix": prefix, "project": project, "client_options": client_options,
                         "timeout_s": timeout_s, "retry": retry}
        self._credentials = credentials
        self.timeout_s, self._retry = timeout_s, retry
        self._is_quick = not retry
        self.endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "Google Cloud Storage"
        self._client_error: Exception | None = None
        try:
            self.client = storage.Client(project=project, credentials=credentials, client_options=client_options)
        except Exception as e:  # no credentials in the chain: said by problem(), raised by any request
            self.client, self._client_error = None, e

    def __repr__(self) -> str:
        return f"GCSObjectStore(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint={self.endpoint!r})"

    def get_uri(self, object_name: str) -> str:
        return f"gs://{self.bucket}/{self.get_key(object_name)}"

    def get_key(self, object_name: str) -> str:
        return f"{self.prefix}{object_name}"

    def _blob(self, object_name: str, **kwargs: Any) -> Any:
        if self.client is None:
            raise self._client_error  # type: ignore[misc]
        return self.client.bucket(self.bucket).blob(self.get_key(object_name), **kwargs)

    def _kwargs(self) -> dict[str, Any]:
        """Each request's timeout, and the client's own retries (up to 120 s of them) unless this is
        a :meth:`quick` store."""
        from google.api_core.retry import Retry

        if not self._retry:
            return {"timeout": self.timeout_s, "retry": Retry(timeout=0)}
        return {"timeout": self.timeout_s}

    def get_object_size(self, object_name: str) -> int:
        try:
            blob = self._blob(object_name)
            blob.reload(**self._kwargs())
            return int(blob.size)
        except Exception as e:
            raise self._translated(e, object_name) from e

    def upload_object(self, object_name: str, filename: str | pathlib.Path,
                      callback: Callable[[int, int], None] | None = None) -> None:
        size = os.path.getsize(filename)
        try:
            self._blob(object_name, chunk_size=PART_BYTES).upload_from_filename(str(filename), **self._kwargs())
        except Exception as e:
            raise self._translated(e, object_name) from e
        if callback is not None:
            callback(size, size)

    def upload_bytes(self, object_name: str, data: bytes) -> None:
        try:
            self._blob(object_name).upload_from_string(data, **self._kwargs())
        except Exception as e:
            raise self._translated(e, object_name) from e

    def read_bytes(self, object_name: str) -> bytes:
        try:
            return self._blob(object_name).download_as_bytes(**self._kwargs())
        except Exception as e:
            raise self._translated(e, object_name) from e

    def download_object(self, object_name: str, filename: str | pathlib.Path, overwrite: bool = False,
                        callback: Callable[[int, int], None] | None = None) -> None:
        with whole_file(filename, overwrite, lambda e: self._translated(e, object_name)) as temp:
            self._blob(object_name, chunk_size=PART_BYTES).download_to_filename(temp, **self._kwargs())
        if callback is not None:
            size = os.path.getsize(filename)
            callback(size, size)

    def delete_object(self, object_name: str) -> None:
        try:
            self._blob(object_name).delete(**self._kwargs())
        except Exception as e:
            error = self._translated(e, object_name)
            if not isinstance(error, FileNotFoundError):
                raise error from e

    def list_objects(self, prefix: str | None = None) -> list[str]:
        if self.client is None:
            raise self._client_error  # type: ignore[misc]
        try:
            return [blob.name for blob in self.client.list_blobs(self.bucket, prefix=self.get_key(prefix or ""),
                                                                 **self._kwargs())]
        except Exception as e:
            raise self._translated(e, prefix or "") from e

    def read_versioned(self, object_name: str) -> Versioned | None:
        from google.api_core import exceptions

        if self.client is None:
            raise self._client_error  # type: ignore[misc]
        try:
            blob = self.client.bucket(self.bucket).get_blob(self.get_key(object_name), **self._kwargs())
            if blob is None:
                return None
            now = self._server_time()
            data = blob.download_as_bytes(if_generation_match=blob.generation, **self._kwargs())
        except exceptions.PreconditionFailed:  # rewritten between the two requests: read it again
            return self.read_versioned(object_name)
        except Exception as e:
            error = self._translated(e, object_name)
            if isinstance(error, FileNotFoundError):
                return None
            raise error from e
        return Versioned(data, str(blob.generation), (now - blob.updated).total_seconds())

    def _server_time(self) -> datetime.datetime:
        """The server's clock (its reply's Date), or this machine's where no reply says it."""
        try:
            base = self.client._connection.API_BASE_URL  # the endpoint the client talks to (an emulator's too)
            reply = self.client._http.get(f"{base}/storage/v1/b/{self.bucket}?fields=name", timeout=self.timeout_s)
            date = reply.headers.get("Date")
            if date:
                return email.utils.parsedate_to_datetime(date)
        except Exception:
            pass
        return datetime.datetime.now(datetime.timezone.utc)

    def put_if(self, object_name: str, data: bytes, *, token: str | None) -> str | None:
        from google.api_core import exceptions

        blob = self._blob(object_name)
        try:
            blob.upload_from_string(data, if_generation_match=0 if token is None else int(token), **self._kwargs())
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            return None
        except Exception as e:
            raise self._translated(e, object_name) from e
        return str(blob.generation)

    def problem(self, object_name: str, *, write: bool) -> str | None:
        if not self._is_quick:  # an endpoint that never answers (a black hole) is said in seconds
            return self.quick().problem(object_name, write=write)
        where = f"bucket {self.bucket!r} at {self.endpoint}"
        if self.client is None:
            return f"{where}: no Google credentials found ({first_line(self._client_error)}): {_CREDENTIALS}"
        try:
            # listing needs only the objects' permission, which a service account for checkpoints has
            list(self.client.list_blobs(self.bucket, prefix=self.get_key(object_name), max_results=1,
                                        **self._kwargs()))
            if write:
                try_a_write(self, object_name)
            return None
        except Exception as e:
            return _explained(e, where)

    def quick(self) -> GCSObjectStore:
        return GCSObjectStore(self.bucket, **{**self._options, "timeout_s": 5.0, "retry": False},
                              credentials=self._credentials)

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in self._options.items() if v is not None}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def _translated(self, error: Exception, object_name: str) -> Exception:
        """FileNotFoundError for a missing object, ObjectStoreTransientError for a connection that
        failed or a server that is unavailable for now; other errors as they are."""
        from google.api_core import exceptions

        if isinstance(error, exceptions.NotFound):
            return FileNotFoundError(f"object {self.get_uri(object_name)} not found")
        if isinstance(error, (exceptions.ServiceUnavailable, exceptions.TooManyRequests,
                              exceptions.InternalServerError, exceptions.GatewayTimeout, ConnectionError,
                              TimeoutError)) or _is_connection_error(error):
            return ObjectStoreTransientError(f"{self.get_uri(object_name)}: {first_line(error)}")
        return error


def _is_connection_error(error: Exception) -> bool:
    try:
        import requests
    except ImportError:
        return False
    return isinstance(error, (requests.ConnectionError, requests.Timeout))


def _explained(error: Exception, where: str) -> str:
    from google.api_core import exceptions

    if isinstance(error, exceptions.RetryError) and isinstance(error.cause, Exception):
        error = error.cause  # what the last of the client's retries failed with
    if isinstance(error, exceptions.NotFound):
        return f"{where} does not exist: create it, or fix the bucket name in the gs:// URI"
    if isinstance(error, (exceptions.Forbidden, exceptions.Unauthorized)):
        return f"{where} refuses these credentials ({first_line(error)}): {_CREDENTIALS}"
    if _is_connection_error(error) or isinstance(error, (ConnectionError, TimeoutError)):
        return (f"{where}: the endpoint does not answer ({first_line(error)}): check STORAGE_EMULATOR_HOST "
                f"(an emulator) or the network")
    return f"{where}: {first_line(error)}"
