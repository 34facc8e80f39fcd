"""Each backend's upload and download throughput through lockstep's store against its client alone
(and obstore, one library for all three), on the server the tests use: SeaweedFS for s3://,
fake-gcs-server for gs://, Azurite for azure://, each started (and stopped) by this script.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/object_store_clients.py [--mb 200] [--rounds 5]
        [--backends s3,gs,azure]

Each round uploads one file with each contender and downloads it back (the contenders' order
turning every round), then checks the bytes; the table gives each one's median MB/s. "lockstep" is
``upload_object``/``download_object`` of the backend's store (what a checkpoint upload runs),
"client" the provider's client called directly with the same part size and concurrency where it
has them, "obstore" the same through obstore (skipped where it is not installed or fails: its GCS
client asks a metadata server for a token even with ``skip_signature``, so not against
fake-gcs-server).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "objectstore"), str(ROOT)]  # emulators imports tests.helpers
import emulators  # noqa: E402
import seaweed  # noqa: E402

PART, CONCURRENCY = 16 << 20, 8
Pair = tuple[Callable[[Path, str], None], Callable[[str, Path], None]]


def lockstep_pair(scheme: str, bucket: str) -> Pair:
    from lockstep.objectstore.uri import store_of

    store = store_of(scheme, bucket)
    return (lambda path, key: store.upload_object(key, path),
            lambda key, path: store.download_object(key, path, overwrite=True))


def client_pair(scheme: str, bucket: str) -> Pair:
    if scheme == "s3":
        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"], region_name="us-east-1")
        config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)
        return (lambda path, key: client.upload_file(str(path), bucket, key, Config=config),
                lambda key, path: client.download_file(bucket, key, str(path), Config=config))
    if scheme == "gs":
        from google.cloud import storage

        gcs = storage.Client().bucket(bucket)
        return (lambda path, key: gcs.blob(key, chunk_size=PART).upload_from_filename(str(path)),
                lambda key, path: gcs.blob(key, chunk_size=PART).download_to_filename(str(path)))
    from azure.storage.blob import ContainerClient

    container = ContainerClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"], bucket,
                                                       max_single_put_size=PART, max_block_size=PART)

    def upload(path: Path, key: str) -> None:
        with open(path, "rb") as f:
            container.upload_blob(key, f, overwrite=True, max_concurrency=CONCURRENCY)

    def download(key: str, path: Path) -> None:
        with open(path, "wb") as f:
            container.download_blob(key, max_concurrency=CONCURRENCY).readinto(f)
    return upload, download


def obstore_pair(scheme: str, bucket: str) -> Pair:
    import obstore
    from obstore.store import AzureStore, GCSStore, S3Store

    if scheme == "s3":
        store = S3Store(bucket, endpoint=os.environ["S3_ENDPOINT_URL"], access_key_id=seaweed.ACCESS_KEY,
                        secret_access_key=seaweed.SECRET_KEY, region="us-east-1", client_options={"allow_http": True})
    elif scheme == "gs":
        store = GCSStore(bucket, config={"base_url": os.environ["STORAGE_EMULATOR_HOST"], "skip_signature": True},
                         client_options={"allow_http": True})
    else:  # Azurite's account, at its endpoint (obstore's use_emulator assumes port 10000)
        endpoint = os.environ["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[1].rstrip(";")
        store = AzureStore(bucket, account_name=emulators.AZURITE_ACCOUNT, account_key=emulators.AZURITE_KEY,
                           endpoint=endpoint, client_options={"allow_http": True})

    def upload(path: Path, key: str) -> None:
        with open(path, "rb") as f:
            obstore.put(store, key, f, chunk_size=PART, max_concurrency=CONCURRENCY)

    def download(key: str, path: Path) -> None:
        with open(path, "wb") as f:
            for chunk in obstore.get(store, key).stream(min_chunk_size=PART):
                f.write(chunk)
    return upload, download


def start(scheme: str):
    if scheme == "s3":
        server = seaweed.start()
    elif scheme == "gs":
        server = emulators.start_fake_gcs()
    else:
        server = emulators.start_azurite()
    os.environ.update(server.env)
    return server


def measure(scheme: str, mb: int, rounds: int, tmp: Path) -> dict[str, tuple[float, float]]:
    server = start(scheme)
    try:
        bucket = server.create_bucket("bench")
        source = tmp / "source.bin"
        if not source.exists():
            source.write_bytes(os.urandom(mb << 20))
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        contenders = {"lockstep": lockstep_pair(scheme, bucket), "client": client_pair(scheme, bucket)}
        try:
            contenders["obstore"] = obstore_pair(scheme, bucket)
        except Exception as e:  # not installed, or no way to point it at this emulator
            print(f"{scheme}: obstore skipped: {type(e).__name__}: {e}")
        rates: dict[str, dict[str, list[float]]] = {n: {"up": [], "down": []} for n in contenders}
        for r in range(rounds):
            names = list(contenders)
            for name in names[r % len(names):] + names[:r % len(names)]:
                upload, download = contenders[name]
                key, back = f"{name}/{r}.bin", tmp / f"{scheme}-{name}-{r}.bin"
                try:
                    t = time.perf_counter()
                    upload(source, key)
                    rates[name]["up"].append(mb / (time.perf_counter() - t))
                    t = time.perf_counter()
                    download(key, back)
                    rates[name]["down"].append(mb / (time.perf_counter() - t))
                except Exception as e:
                    print(f"{scheme}: {name} failed: {type(e).__name__}: {str(e)[:200]}")
                    del contenders[name]
                    continue
                if hashlib.sha256(back.read_bytes()).hexdigest() != digest:
                    raise SystemExit(f"{scheme} {name}: the downloaded bytes differ from the uploaded ones")
                back.unlink()
        return {n: (statistics.median(r["up"]), statistics.median(r["down"])) for n, r in rates.items() if r["up"]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="s3,gs,azure")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in args.backends.split(","):
            results[scheme] = measure(scheme, args.mb, args.rounds, Path(tmp))
    print(f"{args.mb} MB file, median of {args.rounds} rounds, each server on 127.0.0.1")
    print(f"{'backend':<8}{'contender':<10}{'upload MB/s':>13}{'download MB/s':>15}{'upload vs client':>18}")
    for scheme, found in results.items():
        base = found.get("client", (float("nan"),))[0]
        for name, (up, down) in found.items():
            print(f"{scheme:<8}{name:<10}{up:>13.0f}{down:>15.0f}{up / base:>17.2f}x")


if __name__ == "__main__":
    main()
