"""One job across nodes: the launchers agree, through the rendezvous store, on failures and restarts.

On a multi-node run the master's launcher hosts the c10d store (so it outlives every rank and
every restart) and every launcher talks to it under ``lockstep/attempt{N}/``:

* ``alive{node}``: a counter each launcher's beat thread adds to every ``BEAT_S`` seconds. A node
  whose counter stops for ``LOST_AFTER_S`` seconds (its launcher was killed, its machine is gone)
  counts as failed. A node whose ranks all finished adds ``DONE`` to it, so that one ``multi_get``
  of every counter tells each launcher who is alive and who is done: a round trip per launcher
  per check, not one per node.
* ``failures``: one JSON line per failed rank (appended, so none is lost), with its global rank,
  node, host, exit code, wall-clock time and output tail; ``failed`` counts them.
* ``verdict``: the root cause every node prints and exits with. The first launcher to decide sets
  it with compare-and-set; the others read it, so every node tells the same story.
* ``joined`` counts the nodes ready for the attempt: restarts begin together, and a node that
  does not come back fails the job.
* ``port``: a restart's ranks rendezvous in a fresh store that the master's launcher opens on a
  new port (torch's env:// rendezvous keeps no per-attempt prefix, so the old keys would mislead
  them); attempt 0's ranks use the store on ``--master_port`` itself.

Deciding waits until every other node has either beaten after the first failure (it is alive, so
its own failures are in) or is lost, then picks the earliest failure: the rank that failed first,
not a victim whose collective broke because of it.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

BEAT_S = 0.25
LOST_AFTER_S = 3.0
_SETTLE_S = 0.5  # a node must beat this long after the first failure to count as having reported
LOST_EXIT_CODE = 1
DONE = 1 << 40
"""Added to a node's ``alive`` counter once its ranks all finished (no node beats that often)."""


class StoreLost(RuntimeError):
    """The store (the master's launcher) stopped answering."""


@dataclass
class Failure:
    """A failed rank, or a lost node (``rank`` -1), as the launchers record it."""

    node: int
    host: str
    rank: int
    code: int
    when: float
    tail: list[str] = field(default_factory=list)
    pid: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Failure:
        return cls(**json.loads(text))


class JobChannel:
    """This launcher's side of the agreement."""

    def __init__(self, store: Any, beat_store: Any, node: int, nnodes: int) -> None:
        self._store, self._beat_store = store, beat_store
        self.node, self.nnodes = node, nnodes
        self.host = socket.gethostname()
        self._prefix = "lockstep/attempt0/"
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_alive: dict[int, float] = {}
        """Wall-clock time each node was last seen beating: a lost node failed then, before the
        ranks that broke because of it."""
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    @classmethod
    def connect(cls, host: str, port: int, node: int, nnodes: int, server: Any = None) -> JobChannel:
        """Clients of the store at host:port (``server``: the store object this launcher hosts)."""
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=10)
        store = server or TCPStore(host, port, None, False, timeout)
        return cls(store, TCPStore(host, port, None, False, timeout), node, nnodes)

    # -- attempts -----------------------------------------------------------------------------

    def begin(self, attempt: int, timeout: float) -> list[int]:
        """Join ``attempt`` and wait for every node (up to ``timeout`` s); the nodes missing, if any."""
        self._stop_beating()
        self._prefix = f"lockstep/attempt{attempt}/"
        self._seen.clear()
        self._last_alive = dict.fromkeys(range(self.nnodes), time.time())
        self._call(self._store.set, self._key(f"joined{self.node}"), "1")
        self._call(self._store.add, self._key(f"alive{self.node}"), 1)  # every counter exists once all joined
        self._call(self._store.add, self._key("joined"), 1)
        deadline = time.monotonic() + timeout
        while self._call(self._store.add, self._key("joined"), 0) < self.nnodes:
            if time.monotonic() > deadline:
                return [n for n in range(self.nnodes) if not self._call(self._store.check, [self._key(f"joined{n}")])]
            time.sleep(BEAT_S)
        self._beater = threading.Thread(target=self._beat, name="lockstep-beat", daemon=True)
        self._beater.start()
        return []

    def _beat(self) -> None:
        key = self._key(f"alive{self.node}")
        while not self._stop.is_set():
            try:
                self._beat_store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the main thread will see it too
                return
            self._stop.wait(BEAT_S)

    def _stop_beating(self) -> None:
        if self._beater is not None:
            self._stop.set()
            self._beater.join()
            self._stop.clear()
            self._beater = None

    def close(self) -> None:
        self._stop_beating()

    def publish_port(self, attempt: int, port: int) -> None:
        """The master's: where the ranks of ``attempt`` find their store (before :meth:`begin`)."""
        self._call(self._store.set, f"lockstep/attempt{attempt}/port", str(port))

    def port(self, attempt: int) -> int:
        """The ranks' store port of ``attempt`` (after :meth:`begin`: the master set it before joining)."""
        return int(self._call(self._store.get, f"lockstep/attempt{attempt}/port"))

    # -- failures -----------------------------------------------------------------------------

    def report(self, failure: Failure) -> None:
        self._call(self._store.append, self._key("failures"), failure.to_json() + "\n")
        self._call(self._store.add, self._key("failed"), 1)

    def any_failed(self) -> bool:
        return self._call(self._store.add, self._key("failed"), 0) > 0

    def _alive_counts(self) -> list[int]:
        """Every node's ``alive`` counter, in one round trip (each exists once every node joined)."""
        keys = [self._key(f"alive{n}") for n in range(self.nnodes)]
        return [int(v) for v in self._call(self._store.multi_get, keys)]

    def lost_nodes(self) -> list[Failure]:
        """Nodes whose launcher stopped beating, and are not done."""
        now = time.monotonic()
        lost = []
        for n, count in enumerate(self._alive_counts()):
            if n == self.node or count >= DONE:
                continue
            last_count, since = self._seen.get(n, (-1, now))
            if count != last_count:
                self._seen[n] = (count, now)
                self._last_alive[n] = time.time()
            elif now - since >= LOST_AFTER_S:
                lost.append(Failure(n, "?", -1, LOST_EXIT_CODE, self._last_alive[n]))
        return lost

    def decide(self) -> Failure:
        """The agreed root cause (call once a failure is known): wait until every other node has
        reported or is lost, then the earliest failure, as the first decider set it."""
        verdict = self._verdict()
        if verdict is not None:
            return verdict
        start = time.monotonic()
        counts = self._alive_counts()
        waiting = {n for n in range(self.nnodes) if n != self.node}
        lost: list[Failure] = []
        while waiting:
            time.sleep(BEAT_S)
            elapsed = time.monotonic() - start
            now = self._alive_counts()
            for n in list(waiting):
                count = now[n]
                if count >= DONE:
                    waiting.discard(n)
                elif count != counts[n] and elapsed >= _SETTLE_S:
                    waiting.discard(n)  # alive after the failure: its own failures are in
                elif count == counts[n] and elapsed >= LOST_AFTER_S:
                    waiting.discard(n)
                    lost.append(Failure(n, "?", -1, LOST_EXIT_CODE, self._last_alive.get(n, 0.0)))
            verdict = self._verdict()
            if verdict is not None:
                return verdict
        failures = self._failures() + lost
        first = min(failures, key=lambda f: (f.when, f.rank < 0))
        return Failure.from_json(self._call(self._store.compare_set, self._key("verdict"), "",
                                            first.to_json()).decode())

    def _verdict(self) -> Failure | None:
        if self._call(self._store.check, [self._key("verdict")]):
            return Failure.from_json(self._call(self._store.get, self._key("verdict")).decode())
        return None

    def _failures(self) -> list[Failure]:
        if not self._call(self._store.check, [self._key("failures")]):
            return []
        text = self._call(self._store.get, self._key("failures")).decode()
        return [Failure.from_json(line) for line in text.splitlines() if line.strip()]

    # -- success ------------------------------------------------------------------------------

    def finish(self) -> None:
        self._call(self._store.add, self._key(f"alive{self.node}"), DONE)

    def all_done(self) -> bool:
        return all(count >= DONE for count in self._alive_counts())

    def _key(self, name: str) -> str:
        return self._prefix + name

    @staticmethod
    def _call(method: Any, *args: Any) -> Any:
        try:
            return method(*args)
        except Exception as e:  # noqa: BLE001 - torch raises several kinds for a lost connection
            raise StoreLost(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
