"""Why an S3 bucket does not serve this process, in one line naming the bucket and what to change."""

from __future__ import annotations

from typing import Any, Protocol

from lockstep.objectstore.probe import first_line, try_a_write


class S3ObjectStore(Protocol):
    """What this module reads of :class:`lockstep.objectstore.s3.S3ObjectStore` (which imports it)."""

    client: Any
    bucket: str


_CREDENTIALS = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials this bucket "
                "accepts")


def problem(store: S3ObjectStore, key: str, *, write: bool) -> str | None:
    """What keeps ``store`` from serving (and, with ``write``, taking) objects under ``key``; None
    when it works. A write is tried for real: a small object is put and deleted."""
    try:
        store.client.head_bucket(Bucket=store.bucket)
        if write:
            try_a_write(store, key)
        return None
    except Exception as e:
        return _explained(_with_body(e, store), store)


def _with_body(error: Exception, store: S3ObjectStore) -> Exception:
    """The error to explain. A HEAD's reply has no body, so its error code is only the HTTP status
    (404 for a missing bucket and for a web server that is no S3 server alike): the same question as
    a GET gets S3's error document (``NoSuchBucket``), or shows that none comes."""
    import botocore.exceptions

    if not (isinstance(error, botocore.exceptions.ClientError) and _code(error).isdigit()):
        return error
    try:
        store.client.list_objects_v2(Bucket=store.bucket, MaxKeys=1)
    except botocore.exceptions.ClientError as again:
        return again
    except Exception:
        pass
    return error


def _code(error: Any) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _from_s3(error: Any) -> bool:
    """Whether a failed request's reply came from an S3 server. Any request but a HEAD gets S3's
    error document, whose code is a name (``NoSuchBucket``); a web server's page leaves botocore
    only the HTTP status. (Headers do not tell: SeaweedFS's filer and master send ``x-amz-request-id`` too.)"""
    return getattr(error, "operation_name", None) == "HeadBucket" or not _code(error).isdigit()


def _explained(error: Exception, store: object) -> str:
    import botocore.exceptions

    bucket = getattr(store, "bucket", "?")
    endpoint = getattr(store, "endpoint_url", None) or "AWS S3"
    where = f"bucket {bucket!r} at {endpoint}"
    if isinstance(error, botocore.exceptions.NoCredentialsError):
        return f"{where}: no AWS credentials found: {_CREDENTIALS}"
    if isinstance(error, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError,
                          botocore.exceptions.ConnectionError, botocore.exceptions.ReadTimeoutError)):
        return (f"{where}: the endpoint does not answer ({first_line(error)}): check S3_ENDPOINT_URL and that "
                f"the server is running")
    if isinstance(error, botocore.exceptions.ClientError):
        info = error.response.get("Error", {})
        code = str(info.get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if not _from_s3(error):
            server = error.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("server")
            by = f" (server: {server})" if server else ""
            return (f"{where}: the endpoint answered HTTP {status}{by} without S3's error document: it does not "
                    f"look like an S3 server (or a proxy before it failed): check that S3_ENDPOINT_URL (or "
                    f"endpoint_url) names the S3 API (MinIO's API port, SeaweedFS's -s3.port, ...), not a web "
                    f"page, console or filer")
        if code in ("404", "NoSuchBucket", "NotFound"):
            return f"{where} does not exist: create it, or fix the bucket name in the s3:// URI"
        if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden") \
                or status == 403:
            return f"{where} refuses these credentials ({code or status}): {_CREDENTIALS}"
        return f"{where}: {code or status}: {info.get('Message', '')}".rstrip(": ")
    return f"{where}: {first_line(error)}"
