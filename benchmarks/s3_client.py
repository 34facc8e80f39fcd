"""Which S3 client lockstep uses: boto3's transfer manager against obstore, uploading and
downloading one 200 MB file to a SeaweedFS server this script starts (and stops).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/s3_client.py [--mb 200] [--rounds 5]

Each round uploads the file with each client and downloads it back (alternating which client goes
first), then checks the downloaded bytes; the table gives each client's median MB/s over rounds.
Both clients run with their defaults plus the same part size and concurrency (16 MiB parts, 8 at a
time), which is what lockstep's S3ObjectStore uses.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "objectstore"))
import seaweed  # noqa: E402

PART, CONCURRENCY = 16 << 20, 8


def boto3_pair(server: seaweed.SeaweedServer, bucket: str):
    from boto3.s3.transfer import TransferConfig

    client = server.client()
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)

    def upload(path: Path, key: str) -> None:
        client.upload_file(str(path), bucket, key, Config=config)

    def download(key: str, path: Path) -> None:
        client.download_file(bucket, key, str(path), Config=config)
    return upload, download


def obstore_pair(server: seaweed.SeaweedServer, bucket: str):
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=server.endpoint, access_key_id=seaweed.ACCESS_KEY,
                    secret_access_key=seaweed.SECRET_KEY, region="us-east-1",
                    client_options={"allow_http": True})

    def upload(path: Path, key: str) -> None:
        with open(path, "rb") as f:
            obstore.put(store, key, f, chunk_size=PART, max_concurrency=CONCURRENCY)

    def download(key: str, path: Path) -> None:
        result = obstore.get(store, key)
        with open(path, "wb") as f:
            for chunk in result.stream(min_chunk_size=PART):
                f.write(chunk)
    return upload, download


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    server = seaweed.start()
    try:
        bucket = server.create_bucket("bench")
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "source.bin"
            source.write_bytes(os.urandom(args.mb << 20))
            digest = hashlib.sha256(source.read_bytes()).hexdigest()
            clients = {"boto3": boto3_pair(server, bucket), "obstore": obstore_pair(server, bucket)}
            rates: dict[str, dict[str, list[float]]] = {n: {"upload": [], "download": []} for n in clients}
            for r in range(args.rounds):
                order = list(clients) if r % 2 == 0 else list(reversed(clients))
                for name in order:
                    upload, download = clients[name]
                    key, back = f"{name}/{r}.bin", Path(tmp) / f"{name}-{r}.bin"
                    t = time.perf_counter()
                    upload(source, key)
                    rates[name]["upload"].append(args.mb / (time.perf_counter() - t))
                    t = time.perf_counter()
                    download(key, back)
                    rates[name]["download"].append(args.mb / (time.perf_counter() - t))
                    if hashlib.sha256(back.read_bytes()).hexdigest() != digest:
                        raise SystemExit(f"{name}: the downloaded bytes differ from the uploaded ones")
                    back.unlink()
        print(f"{args.mb} MB file, SeaweedFS on 127.0.0.1, median of {args.rounds} rounds")
        print(f"{'client':<10}{'upload MB/s':>14}{'download MB/s':>16}")
        for name, r in rates.items():
            print(f"{name:<10}{statistics.median(r['upload']):>14.0f}{statistics.median(r['download']):>16.0f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
