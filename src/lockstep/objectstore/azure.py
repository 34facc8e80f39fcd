"""An Azure Blob Storage container through Microsoft's own client (``azure-storage-blob``):
``azure://CONTAINER/PREFIX`` (Composer's scheme; ``az://`` too).

The account comes from ``AZURE_STORAGE_CONNECTION_STRING``, else ``AZURE_STORAGE_ACCOUNT`` and
``AZURE_STORAGE_KEY`` (with ``AZURE_STORAGE_ACCOUNT_URL`` for an endpoint other than
``https://ACCOUNT.blob.core.windows.net``), unless given; Azurite's connection string serves its
emulator. Large files go up in blocks of :data:`PART_BYTES`, several at a time; a version token
is the blob's ETag, which ``If-None-Match: *`` and ``If-Match`` condition a write on.
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

AZURE_INSTALL_HINT = "pip install 'torch-lockstep[azure]' (azure-storage-blob)"
PART_BYTES = 16 << 20
"""Files larger than this go up in blocks of this size, :data:`CONCURRENCY` at a time."""
CONCURRENCY = 8
_ACCOUNT = ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT and AZURE_STORAGE_KEY, to an "
            "account this container accepts")


class AzureObjectStore:
    """Objects in the Azure ``container`` under ``prefix``. ``connection_string``, or
    ``account_name`` and ``account_key`` (and ``account_url``), default to the environment (see
    the module); ``timeout_s`` bounds each request and ``retry_total`` the client's retries."""

    scheme = "azure"

    def __init__(self, container: str, prefix: str = "", connection_string: str | None = None,
                 account_name: str | None = None, account_key: str | None = None, account_url: str | None = None,
                 timeout_s: float = 60.0, retry_total: int = 3) -> None:
        try:
            from azure.storage.blob import BlobServiceClient, ExponentialRetry
        except ImportError as e:
            raise ImportError(f"Azure object stores need azure-storage-blob: {AZURE_INSTALL_HINT}") from e
        self.bucket = container.strip("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._options = {"prefix": prefix, "connection_string": connection_string, "account_name": account_name,
                         "account_key": account_key, "account_url": account_url, "timeout_s": timeout_s,
                         "retry_total": retry_total}
        self.timeout_s = timeout_s
        self._is_quick = retry_total <= 1
        # the client's default waits 15 s, then 45 s, between tries: a minute before a dead endpoint is said
        retry = ExponentialRetry(initial_backoff=0.5, increment_base=1.5, retry_total=retry_total,
                                 random_jitter_range=0.5)
        client_kwargs = {"retry_policy": retry, "connection_timeout": min(timeout_s, 20),
                         "read_timeout": timeout_s, "max_single_put_size": PART_BYTES, "max_block_size": PART_BYTES}
        connection_string = connection_string or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        account_name = account_name or os.environ.get("AZURE_STORAGE_ACCOUNT")
        account_key = account_key or os.environ.get("AZURE_STORAGE_KEY")
        account_url = account_url or os.environ.get("AZURE_STORAGE_ACCOUNT_URL")
        self._missing: str | None = None
        if connection_string:
            self.service = BlobServiceClient.from_connection_string(connection_string, **client_kwargs)
        elif account_name and account_key:
            url = account_url or f"https://{account_name}.blob.core.windows.net"
            self.service = BlobServiceClient(url, credential={"account_name": account_name,
                                                              "account_key": account_key}, **client_kwargs)
        else:
            self.service, self._missing = None, "no Azure storage account given"
        self.endpoint = self.service.url if self.service is not None else "Azure Blob Storage"
        self.container = None if self.service is None else self.service.get_container_client(self.bucket)

    def __repr__(self) -> str:
        return f"AzureObjectStore(container={self.bucket!r}, prefix={self.prefix!r}, endpoint={self.endpoint!r})"

    def get_uri(self, object_name: str) -> str:
        return f"azure://{self.bucket}/{self.get_key(object_name)}"

    def get_key(self, object_name: str) -> str:
        return f"{self.prefix}{object_name}"

    def _blob(self, object_name: str) -> Any:
        if self.container is None:
            raise ValueError(f"{self.get_uri(object_name)}: {self._missing}: {_ACCOUNT}")
        return self.container.get_blob_client(self.get_key(object_name))

    def get_object_size(self, object_name: str) -> int:
        try:
            return int(self._blob(object_name).get_blob_properties(timeout=self.timeout_s).size)
        except Exception as e:
            raise self._translated(e, object_name) from e

    def upload_object(self, object_name: str, filename: str | pathlib.Path,
                      callback: Callable[[int, int], None] | None = None) -> None:
        size = os.path.getsize(filename)
        hook = None if callback is None else (lambda done, total: callback(done, size))
        try:
            with open(filename, "rb") as data:
                self._blob(object_name).upload_blob(data, length=size, overwrite=True, max_concurrency=CONCURRENCY,
                                                    timeout=self.timeout_s, progress_hook=hook)
        except Exception as e:
            raise self._translated(e, object_name) from e

    def upload_bytes(self, object_name: str, data: bytes) -> None:
        try:
            self._blob(object_name).upload_blob(data, overwrite=True, timeout=self.timeout_s)
        except Exception as e:
            raise self._translated(e, object_name) from e

    def read_bytes(self, object_name: str) -> bytes:
        try:
            return self._blob(object_name).download_blob(timeout=self.timeout_s).readall()
        except Exception as e:
            raise self._translated(e, object_name) from e

    def download_object(self, object_name: str, filename: str | pathlib.Path, overwrite: bool = False,
                        callback: Callable[[int, int], None] | None = None) -> None:
        hook = None if callback is None else (lambda done, total: callback(done, total or 0))
        with whole_file(filename, overwrite, lambda e: self._translated(e, object_name)) as temp, \
                open(temp, "wb") as out:
            self._blob(object_name).download_blob(max_concurrency=CONCURRENCY, timeout=self.timeout_s,
                                                  progress_hook=hook).readinto(out)

    def delete_object(self, object_name: str) -> None:
        try:
            self._blob(object_name).delete_blob(timeout=self.timeout_s)
        except Exception as e:
            error = self._translated(e, object_name)
            if not isinstance(error, FileNotFoundError):
                raise error from e

    def list_objects(self, prefix: str | None = None) -> list[str]:
        if self.container is None:
            raise ValueError(f"{self.get_uri(prefix or '')}: {self._missing}: {_ACCOUNT}")
        try:
            return [b.name for b in self.container.list_blobs(name_starts_with=self.get_key(prefix or ""),
                                                              timeout=self.timeout_s)]
        except Exception as e:
            raise self._translated(e, prefix or "") from e

    def read_versioned(self, object_name: str) -> Versioned | None:
        reply: dict[str, str] = {}

        def keep_date(response: Any) -> None:
            reply["date"] = response.http_response.headers.get("Date", "")

        try:
            download = self._blob(object_name).download_blob(timeout=self.timeout_s, raw_response_hook=keep_date)
            data = download.readall()
        except Exception as e:
            error = self._translated(e, object_name)
            if isinstance(error, FileNotFoundError):
                return None
            raise error from e
        # without the server's Date (a proxy dropped it), this machine's clock stands in for it
        now = email.utils.parsedate_to_datetime(reply["date"]) if reply.get("date") \
            else datetime.datetime.now(datetime.timezone.utc)
        return Versioned(data, download.properties.etag, (now - download.properties.last_modified).total_seconds())

    def put_if(self, object_name: str, data: bytes, *, token: str | None) -> str | None:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

        condition = {"if_none_match": "*"} if token is None \
            else {"etag": token, "match_condition": MatchConditions.IfNotModified}
        try:
            reply = self._blob(object_name).upload_blob(data, overwrite=True, timeout=self.timeout_s, **condition)
        except (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError):
            return None
        except Exception as e:
            raise self._translated(e, object_name) from e
        return reply["etag"]

    def problem(self, object_name: str, *, write: bool) -> str | None:
        if not self._is_quick:  # an endpoint that never answers (a black hole) is said in seconds
            return self.quick().problem(object_name, write=write)
        where = f"container {self.bucket!r} at {self.endpoint}"
        if self.container is None:
            return f"{where}: {self._missing}: {_ACCOUNT}"
        try:
            self.container.get_container_properties(timeout=self.timeout_s)
            if write:
                try_a_write(self, object_name)
            return None
        except Exception as e:
            return _explained(e, where)

    def quick(self) -> AzureObjectStore:
        return AzureObjectStore(self.bucket, **{**self._options, "timeout_s": 5.0, "retry_total": 1})

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in self._options.items() if v is not None}

    def close(self) -> None:
        if self.service is not None:
            self.service.close()

    def _translated(self, error: Exception, object_name: str) -> Exception:
        """FileNotFoundError for a missing blob, ObjectStoreTransientError for a connection that
        failed; other errors as they are."""
        from azure.core.exceptions import ResourceNotFoundError, ServiceRequestError, ServiceResponseError

        if isinstance(error, ResourceNotFoundError):
            return FileNotFoundError(f"object {self.get_uri(object_name)} not found")
        if isinstance(error, (ServiceRequestError, ServiceResponseError)):
            return ObjectStoreTransientError(f"{self.get_uri(object_name)}: {first_line(error)}")
        return error


def _explained(error: Exception, where: str) -> str:
    from azure.core.exceptions import (ClientAuthenticationError, HttpResponseError, ResourceNotFoundError,
                                       ServiceRequestError, ServiceResponseError)

    if isinstance(error, ResourceNotFoundError):
        return f"{where} does not exist: create it, or fix the container name in the azure:// URI"
    if isinstance(error, ClientAuthenticationError) or (isinstance(error, HttpResponseError)
                                                        and error.status_code in (401, 403)):
        return f"{where} refuses this account's key ({first_line(error)}): {_ACCOUNT}"
    if isinstance(error, (ServiceRequestError, ServiceResponseError)):  # no connection, or no reply
        return (f"{where}: the endpoint does not answer ({first_line(error)}): check the connection string's "
                f"BlobEndpoint (an emulator) or the network")
    return f"{where}: {first_line(error)}"
