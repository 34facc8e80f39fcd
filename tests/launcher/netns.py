"""Test hosts: Linux network namespaces with addresses of their own, joined by a switch.

``Hosts(n)`` makes n namespaces ("hosts") and one more that holds a bridge per network (the
"switch"). Host i has an interface ``net<k>`` on each network k, with the address
``10.77.<x>.<64 k + i + 1>/26``, and its loopback up. Every veth is created directly inside the
namespaces the test made, so nothing is added to the namespace the tests run in, and ``x`` is
taken by creating the switch namespace ``lst<x>sw`` (``ip netns add`` fails for a name that
exists): concurrent runs get different ``x``, hence different names and addresses.

:meth:`Hosts.cut` takes a host's switch port down: its packets are dropped silently, as when a
cable or a top-of-rack switch fails (the host's own interface stays up, so nothing tells its
sockets). :meth:`Hosts.heal` brings the port back.

Cleanup always runs: :meth:`Hosts.close` (the ``hosts`` fixture's finalizer, and an atexit hook
for a test process that dies otherwise) kills every process started in a host, whether through
:meth:`Hosts.popen` or not, and deletes the namespaces, which deletes their veths. A test process
killed by SIGKILL runs neither: an owner holds a lock on ``x`` (a ``flock`` on a file, which the
kernel drops when its holder dies) from before it makes the namespaces until they are deleted, and
the first ``Hosts`` of a later process deletes the namespaces of every ``x`` whose lock it can take
(:func:`sweep`).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.objectstore.seaweed import dying_with_parent

_PREFIX = "lst"
_HOSTS_PER_NETWORK = 62  # a /26 per network
_OWNERS = Path(tempfile.gettempdir()) / "lockstep-netns"
"""One lock file per ``x``: its owner holds a ``flock`` on it (the files stay, so that a lock is
always taken on the one file every process opens)."""
_swept = False


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespace hosts need root (CI runs the tests as root)"
    if shutil.which("ip") is None:
        return "network namespace hosts need iproute2's `ip` command"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


class Hosts:
    """``count`` namespace hosts on ``networks`` networks (see the module's docstring)."""

    def __init__(self, count: int, networks: int = 1) -> None:
        if not 1 <= count <= _HOSTS_PER_NETWORK or not 1 <= networks <= 4:
            raise ValueError(f"Hosts supports 1 to {_HOSTS_PER_NETWORK} hosts on 1 to 4 networks")
        self.count, self.networks = count, networks
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        self._lock: int | None = None
        global _swept
        if not _swept:
            sweep()
            _swept = True
        atexit.register(self.close)
        self.x = self._claim()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- naming ---------------------------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"{_PREFIX}{self.x}sw"

    def name(self, host: int) -> str:
        """The namespace of ``host``."""
        return f"{_PREFIX}{self.x}h{host}"

    def address(self, host: int, network: int = 0) -> str:
        return f"10.77.{self.x}.{64 * network + host + 1}"

    @staticmethod
    def interface(network: int = 0) -> str:
        return f"net{network}"

    # -- building -------------------------------------------------------------------------------

    def _claim(self) -> int:
        """Take the lock of a free ``x``, then make its switch namespace."""
        for x in random.sample(range(256), 256):
            existed = (_OWNERS / str(x)).exists()
            lock = _lock(x, create=True)
            if lock is None:
                continue  # a live owner
            if not existed and x in _namespaces():  # made by something that takes no lock: not ours
                os.close(lock)
                continue
            _delete_namespaces_of(x)  # left by an owner that died: its lock is free
            made = _ip("netns", "add", f"{_PREFIX}{x}sw", check=False)
            if made.returncode == 0:
                self._lock = lock
                self._made.append(f"{_PREFIX}{x}sw")
                return x
            os.close(lock)
            if "exists" not in made.stderr:
                raise RuntimeError(f"ip netns add: {made.stderr.strip()}")
        raise RuntimeError("no free 10.77.x.0/24 for namespace hosts: every lst<x>sw namespace exists")

    def _build(self) -> None:
        sw = self.switch
        _ip("-n", sw, "link", "set", "lo", "up")
        for k in range(self.networks):
            _ip("-n", sw, "link", "add", f"br{k}", "type", "bridge")
            _ip("-n", sw, "link", "set", f"br{k}", "up")
        for i in range(self.count):
            ns = self.name(i)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            for k in range(self.networks):
                port = self._port(i, k)
                _ip("link", "add", self.interface(k), "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
                _ip("-n", sw, "link", "set", port, "master", f"br{k}")
                _ip("-n", sw, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i, k)}/26", "dev", self.interface(k))
                _ip("-n", ns, "link", "set", self.interface(k), "up")

    @staticmethod
    def _port(host: int, network: int) -> str:
        return f"h{host}n{network}"

    # -- using ----------------------------------------------------------------------------------

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` (in a session of its own); it is killed at :meth:`close`,
        and dies with this process even when that is killed (``ip netns exec`` execs ``argv``, which
        keeps the parent-death signal)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.name(host), *dying_with_parent(list(argv))],
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def cut(self, host: int, network: int = 0) -> None:
        """Drop every packet to and from ``host`` on ``network`` (its switch port goes down)."""
        _ip("-n", self.switch, "link", "set", self._port(host, network), "down")

    def heal(self, host: int, network: int = 0) -> None:
        _ip("-n", self.switch, "link", "set", self._port(host, network), "up")

    def pids(self, host: int) -> list[int]:
        """Every process that runs in ``host``'s namespace."""
        out = _ip("netns", "pids", self.name(host), check=False).stdout
        return [int(p) for p in out.split()]

    # -- cleaning up ----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the hosts and delete the namespaces (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for ns in reversed(self._made):
            _delete(ns)
        self._made.clear()
        if self._lock is not None:  # after the namespaces are gone
            os.close(self._lock)
            self._lock = None
        atexit.unregister(self.close)


def _delete(ns: str) -> None:
    """Kill the processes in ``ns`` (however they were started: a rank's children, a daemon), then
    delete it."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


def _lock(x: int, *, create: bool) -> int | None:
    """A descriptor holding the lock of ``x``; None while another process holds it, or when it has
    no lock file and ``create`` is false."""
    _OWNERS.mkdir(exist_ok=True)
    try:
        fd = os.open(_OWNERS / str(x), os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _namespaces() -> dict[int, list[str]]:
    """The test hosts' namespaces that exist, by their ``x``."""
    found: dict[int, list[str]] = {}
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        match = re.fullmatch(rf"{_PREFIX}(\d+)(sw|h\d+)", line.split()[0]) if line.strip() else None
        if match:
            found.setdefault(int(match[1]), []).append(match[0])
    return found


def _delete_namespaces_of(x: int) -> list[str]:
    """Delete the namespaces of ``x`` (the caller holds its lock): hosts first, the switch last."""
    names = sorted(_namespaces().get(x, []), key=lambda name: name.endswith("sw"))
    for name in names:
        _delete(name)
    return names


def sweep() -> list[str]:
    """Delete the namespaces of test processes that died without cleaning up (SIGKILL): those of
    every ``x`` that has a lock file and whose lock is free. The names deleted; a live owner's, and
    namespaces of an ``x`` no owner ever locked, are never touched."""
    swept = []
    for x in _namespaces():
        lock = _lock(x, create=False)
        if lock is not None:
            try:
                swept += _delete_namespaces_of(x)
            finally:
                os.close(lock)
    return swept


def make_hosts(count: int, networks: int = 1) -> Iterator[Hosts]:
    """A fixture body: skips with the reason when namespace hosts cannot be made here."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        hosts = Hosts(count, networks)
    except RuntimeError as e:  # an `ip` command this machine refuses (no CAP_NET_ADMIN, no veth, ...)
        pytest.skip(f"network namespace hosts cannot be made here: {e}")
    try:
        yield hosts
    finally:
        hosts.close()
