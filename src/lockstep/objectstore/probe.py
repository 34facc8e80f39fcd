"""Before training: can this process reach the bucket, with these credentials, and write there?
Each failure is one line naming the bucket and what to change."""

from __future__ import annotations

import uuid

from lockstep.objectstore.store import ObjectStore

_CREDENTIALS = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials this bucket "
                "accepts")


def problem(store: ObjectStore, key: str, *, write: bool) -> str | None:
    """What keeps ``store`` from serving (and, with ``write``, taking) objects under ``key``; None
    when it works. A write is tried for real: a small object is put and deleted."""
    from lockstep.objectstore.s3 import S3ObjectStore

    if not isinstance(store, S3ObjectStore):
        try:
            store.list_objects(key)
        except Exception as e:
            return f"object store {store!r} cannot list {key!r}: {_first_line(e)}"
        return None
    probe_name = f"{key.rstrip('/')}/.lockstep-probe-{uuid.uuid4().hex}" if key else f".lockstep-probe-{uuid.uuid4().hex}"
    try:
        store.client.head_bucket(Bucket=store.bucket)
        if write:
            store.upload_bytes(probe_name, b"")
            store.delete_object(probe_name)
        return None
    except Exception as e:
        return _explained(e, store)


def _explained(error: Exception, store: object) -> str:
    import botocore.exceptions

    bucket = getattr(store, "bucket", "?")
    endpoint = getattr(store, "endpoint_url", None) or "AWS S3"
    where = f"bucket {bucket!r} at {endpoint}"
    if isinstance(error, botocore.exceptions.NoCredentialsError):
        return f"{where}: no AWS credentials found: {_CREDENTIALS}"
    if isinstance(error, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError,
                          botocore.exceptions.ConnectionError)):
        return (f"{where}: the endpoint does not answer ({_first_line(error)}): check S3_ENDPOINT_URL and that "
                f"the server is running")
    if isinstance(error, botocore.exceptions.ClientError):
        info = error.response.get("Error", {})
        code = str(info.get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchBucket", "NotFound"):
            return f"{where} does not exist: create it, or fix the bucket name in the s3:// URI"
        if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden") \
                or status == 403:
            return f"{where} refuses these credentials ({code or status}): {_CREDENTIALS}"
        return f"{where}: {code or status}: {info.get('Message', '')}".rstrip(": ")
    return f"{where}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
