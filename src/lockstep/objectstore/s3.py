"""An S3 bucket (AWS or any S3-compatible server) through boto3, as Composer's ``S3ObjectStore``.

boto3 was chosen over obstore by measurement (benchmarks/s3_client.py): on a 200 MB file against
SeaweedFS, uploads were within noise of each other and boto3's transfer manager downloaded about
2.5x faster; it is also what Composer's ``S3ObjectStore`` uses, so ``client_config`` and
``transfer_config`` mean the same here. Large files go in parts, several at a time.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

from lockstep.objectstore.store import ObjectStoreTransientError, Versioned, whole_file

S3_INSTALL_HINT = "pip install 'torch-lockstep[s3]' (boto3)"
PART_BYTES = 16 << 20
"""Files larger than this go up and down in parts of this size, several at a time."""
_NOT_FOUND = ("404", "NoSuchKey", "NotFound")
_CONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
_UNSUPPORTED = ("NotImplemented", "501")
"""What a server that does not take conditional writes answers to one."""


_LOADER: Any = None
"""botocore's loader of service models, one per process (:func:`_session`)."""


def _session(boto3: Any) -> Any:
    """A new boto3 Session whose service models come from the process's one loader: each Session
    would parse S3's JSON model again, ~0.1 s of CPU for every store a process makes."""
    global _LOADER
    import botocore.loaders
    import botocore.session

    if _LOADER is None:
        _LOADER = botocore.loaders.create_loader()
    core = botocore.session.get_session()
    core.register_component("data_loader", _LOADER)
    session = boto3.Session(botocore_session=core)
    _LOADER.search_paths[:] = list(dict.fromkeys(_LOADER.search_paths))  # boto3 adds its folder every time
    return session


class S3ObjectStore:
    """Objects in ``bucket`` under ``prefix``. Credentials come from the AWS chain
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance
    roles, ...) unless given; the endpoint from ``endpoint_url`` or ``S3_ENDPOINT_URL`` (MinIO,
    SeaweedFS, ...). ``client_config`` is passed to ``botocore.config.Config`` and
    ``transfer_config`` to ``boto3.s3.transfer.TransferConfig``, as in Composer."""

    scheme = "s3"

    def __init__(self, bucket: str, prefix: str = "", region_name: str | None = None,
                 endpoint_url: str | None = None, aws_access_key_id: str | None = None,
                 aws_secret_access_key: str | None = None, aws_session_token: str | None = None,
                 client_config: dict[str, Any] | None = None, transfer_config: dict[str, Any] | None = None) -> None:
        self._options = {"prefix": prefix, "region_name": region_name, "endpoint_url": endpoint_url,
                         "aws_access_key_id": aws_access_key_id, "aws_secret_access_key": aws_secret_access_key,
                         "aws_session_token": aws_session_token, "client_config": client_config,
                         "transfer_config": transfer_config}
        self._conditional = True
        """False once the server refused a conditional write as not implemented (an old
        S3-compatible server): conditional writes are then plain ones."""
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as e:
            raise ImportError(f"S3 object stores need boto3: {S3_INSTALL_HINT}") from e
        self.bucket = bucket.strip("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        if endpoint_url is None:
            endpoint_url = os.environ.get("S3_ENDPOINT_URL") or None
        self.endpoint_url = endpoint_url
        config = {"retries": {"mode": "adaptive"}, "connect_timeout": 10,
                  "max_pool_connections": 32, **(client_config or {})}
        self.client = _session(boto3).client(
            "s3", config=Config(**config), region_name=region_name or _default_region(endpoint_url),
            endpoint_url=endpoint_url, aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key, aws_session_token=aws_session_token)
        transfer = {"multipart_threshold": PART_BYTES, "multipart_chunksize": PART_BYTES,
                    "max_concurrency": 8, **(transfer_config or {})}
        self.transfer_config = TransferConfig(**transfer)

    def __repr__(self) -> str:
        return f"S3ObjectStore(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint_url={self.endpoint_url!r})"

    def get_uri(self, object_name: str) -> str:
        return f"s3://{self.bucket}/{self.get_key(object_name)}"

    def get_key(self, object_name: str) -> str:
        return f"{self.prefix}{object_name}"

    def get_object_size(self, object_name: str) -> int:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.get_key(object_name))["ContentLength"])
        except Exception as e:
            raise self._translated(e, object_name) from e

    def upload_object(self, object_name: str, filename: str | pathlib.Path,
                      callback: Callable[[int, int], None] | None = None) -> None:
        size = os.path.getsize(filename)
        progress = None if callback is None else _Progress(callback, size)
        try:
            self.client.upload_file(Filename=str(filename), Bucket=self.bucket, Key=self.get_key(object_name),
                                    Callback=progress, Config=self.transfer_config)
        except Exception as e:
            raise self._translated(e, object_name) from e

    def upload_bytes(self, object_name: str, data: bytes) -> None:
        """Put a small object (a latest pointer) in one request."""
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.get_key(object_name), Body=data)
        except Exception as e:
            raise self._translated(e, object_name) from e

    def read_bytes(self, object_name: str) -> bytes:
        """A small object's content; FileNotFoundError when there is none."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.get_key(object_name))["Body"].read()
        except Exception as e:
            raise self._translated(e, object_name) from e

    def download_object(self, object_name: str, filename: str | pathlib.Path, overwrite: bool = False,
                        callback: Callable[[int, int], None] | None = None) -> None:
        with whole_file(filename, overwrite, lambda e: self._translated(e, object_name)) as temp:
            progress = None if callback is None else _Progress(callback, self.get_object_size(object_name))
            self.client.download_file(Bucket=self.bucket, Key=self.get_key(object_name), Filename=temp,
                                      Callback=progress, Config=self.transfer_config)

    def delete_object(self, object_name: str) -> None:
        """Delete ``object_name`` (nothing happens when there is none)."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.get_key(object_name))
        except Exception as e:
            raise self._translated(e, object_name) from e

    def list_objects(self, prefix: str | None = None) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                     Prefix=self.get_key(prefix or ""))
        try:
            return [obj["Key"] for page in pages for obj in page.get("Contents", [])]
        except Exception as e:
            raise self._translated(e, prefix or "") from e

    def read_versioned(self, object_name: str) -> Versioned | None:
        import datetime
        import email.utils

        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.get_key(object_name))
        except Exception as e:
            error = self._translated(e, object_name)
            if isinstance(error, FileNotFoundError):
                return None
            raise error from e
        data = reply["Body"].read()
        date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        # without the server's Date (a proxy dropped it), this machine's clock stands in for it
        now = email.utils.parsedate_to_datetime(date) if date else datetime.datetime.now(datetime.timezone.utc)
        return Versioned(data, reply["ETag"], (now - reply["LastModified"]).total_seconds())

    def put_if(self, object_name: str, data: bytes, *, token: str | None) -> str | None:
        import botocore.exceptions

        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            reply = self.client.put_object(Bucket=self.bucket, Key=self.get_key(object_name), Body=data,
                                           **(condition if self._conditional else {}))
        except botocore.exceptions.ParamValidationError:  # a boto3 older than 1.35.69, below torch-lockstep[s3]
            if not self._conditional:
                raise
            self._conditional = False
            return self.put_if(object_name, data, token=token)
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _CONDITION_FAILED or status in _CONDITION_FAILED:
                return None
            if code in ("NoSuchKey", "404") and token is not None:
                return None  # deleted meanwhile
            if (code in _UNSUPPORTED or status in _UNSUPPORTED) and self._conditional:
                self._conditional = False
                return self.put_if(object_name, data, token=token)
            raise
        return reply.get("ETag")

    def problem(self, object_name: str, *, write: bool) -> str | None:
        from lockstep.objectstore import s3_errors

        # through the quick client: an endpoint that takes the connection and never answers (a
        # black hole) is said in seconds, not after the client's minutes of timeouts and retries
        return s3_errors.problem(self.quick(), object_name, write=write)

    def quick(self) -> S3ObjectStore:
        return S3ObjectStore(self.bucket, **{**self._options, "client_config": {
            "connect_timeout": 2, "read_timeout": 5, "retries": {"mode": "standard", "total_max_attempts": 2}}})

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in self._options.items() if v is not None}

    def close(self) -> None:
        self.client.close()

    def _translated(self, error: Exception, object_name: str) -> Exception:
        """FileNotFoundError for a missing object, ObjectStoreTransientError for a connection that
        failed; other errors as they are."""
        import botocore.exceptions

        if isinstance(error, botocore.exceptions.ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND:
                return FileNotFoundError(f"object {self.get_uri(object_name)} not found")
        if isinstance(error, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
            return ObjectStoreTransientError(f"{self.get_uri(object_name)}: {error}")
        return error


def _default_region(endpoint_url: str | None) -> str | None:
    """A custom endpoint (MinIO, SeaweedFS) takes any region; boto3 needs one to sign requests."""
    if endpoint_url and not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
        return "us-east-1"
    return None


class _Progress:
    """boto3 reports bytes per chunk; Composer's callbacks take (bytes so far, total)."""

    def __init__(self, callback: Callable[[int, int], None], total: int) -> None:
        self.callback, self.total, self.done = callback, total, 0

    def __call__(self, chunk: int) -> None:
        self.done += chunk
        self.callback(self.done, self.total)
