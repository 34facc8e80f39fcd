"""One job across nodes: the launchers agree, through the rendezvous store, on failures and restarts.

On a multi-node run the master's launcher hosts the c10d store (so it outlives every rank and
every restart) and every launcher talks to it under ``lockstep/attempt{N}/``:

* ``alive{node}``: a counter each launcher's beat thread adds to every ``BEAT_S`` seconds. A node
  whose counter stops for ``LOST_AFTER_S`` seconds (its launcher was killed, its machine is gone)
  counts as failed. A node whose ranks all finished adds ``DONE`` to it, so that one ``multi_get``
  of every counter tells each launcher who is alive and who is done: a round trip per launcher
  per check, not one per node.
* ``failures``: one JSON line per failure (appended, so none is lost): a rank that failed, a
  stalled rank, a launcher that received a stopping signal or a lost node, with its global rank,
  node, host, exit code, wall-clock time and output tail; ``failed`` counts them.
* ``stage{node}``: ``REPORTED`` once the launcher has recorded every failure it will (it is
  deciding, or was signalled), ``LEFT`` once it no longer uses the store; node 0's launcher keeps
  the store up until every other one left, so that none misses the verdict.
* ``verdict``: the root cause every node prints and exits with. The first launcher to decide sets
  it with compare-and-set; the others read it, so every node tells the same story.
* ``joined`` counts the nodes ready for the attempt: restarts begin together, and a node that
  does not come back fails the job.
* ``port``: a restart's ranks rendezvous in a fresh store that the master's launcher opens on a
  new port (torch's env:// rendezvous keeps no per-attempt prefix, so the old keys would mislead
  them); attempt 0's ranks use the store on ``--master_port`` itself.

Outside the attempts' prefixes, ``lockstep/attempt`` is the attempt the master's launcher is in.
The other nodes follow it rather than count for themselves: a node that lost the master during a
join, or a launcher started again in place of a killed one, joins the attempt the master waits
in, not one of its own numbering (the two sides would each wait for the other until
``--rdzv_timeout``).

Every store call has a deadline (:class:`~lockstep.launcher.store.StoreClient`); while one is out,
the launcher's main thread does its other work through the ``meanwhile`` hook the supervisor sets.

Deciding waits until every other node has reported, left, finished or is lost, then picks the
earliest failure: the rank that failed first, not a victim whose collective broke because of it.
On a stall, every node first prints its own ranks' stacks and records what it found: a rank that
stopped outside a collective outranks any rank found waiting in one, whichever node saw it first.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from lockstep.launcher import wire_store
from lockstep.launcher.rendezvous import TELL_S
from lockstep.launcher.store import CALL_S, Meanwhile, Stopped, StoreClient, StoreLost, idle, tcp_store

__all__ = ["CALL_S", "Failure", "JobChannel", "Stopped", "StoreClient", "StoreLost", "root_cause", "tcp_store"]

BEAT_S = 0.25
LOST_AFTER_S = 3.0
_SILENT_S = 10.0
"""A node that beats but has not reported this long after deciding began is not waited for."""
LOST_EXIT_CODE = 1
ATTEMPT_KEY = "lockstep/attempt"
DONE = 1 << 40
"""Added to a node's ``alive`` counter once its ranks all finished (no node beats that often)."""


_RUNNING, _REPORTED, _LEFT = 0, 1, 2  # a node's stage

EXITED = "exited"
"""The rank exited with ``code``."""
LOST = "lost"
"""The node's launcher stopped answering (``rank`` -1)."""
SIGNALLED = "signalled"
"""The node's launcher received signal ``code`` - 128 and stopped its ranks (``rank`` -1)."""
ECHOED = "echoed"
"""The rank exited with ``code`` raising another rank's error (an agreed failure): a symptom."""
STOPPED = "stopped"
"""A stall: the rank made no progress and its main thread is not in a collective."""
WAITING = "waiting"
"""A stall: the rank waits in a collective, and its node found no rank stopped outside one."""
STALLS = (STOPPED, WAITING)
GROWING = "growing"
"""Not a failure: node ``node`` asks to join a job whose ranks follow no change of the membership
(a torchrun script), and every node starts its ranks again with it, as torchrun's agents do. It
counts against no ``--max_restarts``, and yields to any failure recorded with it."""


@dataclass
class Failure:
    """What went wrong on one node, as the launchers record it; ``cause`` says which kind."""

    node: int
    host: str
    rank: int
    code: int
    when: float
    tail: list[str] = field(default_factory=list)
    pid: int = 0
    cause: str = EXITED
    ended: float = 0.0
    """When the rank's script ended with its error (its own record; 0: none): earlier than ``when``,
    the report, by the time its exit took."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Failure:
        return cls(**json.loads(text))


def root_cause(failures: list[Failure]) -> Failure:
    """The earliest failure; a rank found waiting in a stalled collective, or failing with another
    rank's error, is a symptom, named only when no node recorded anything else, and a lost node
    yields to a rank failure at the same time. Ranks compare by when their scripts ended where
    they recorded it, unless a node was lost: its time is when another node last saw it beat, which
    only the reports' times can be set against."""
    exact = not any(f.cause == LOST for f in failures)

    def when(f: Failure) -> float:
        return f.ended or f.when if exact else f.when
    return min(failures, key=lambda f: (f.cause == GROWING, f.cause == WAITING, f.cause == ECHOED, when(f),
                                        f.cause == LOST))


class JobChannel:
    """This launcher's side of the agreement."""

    def __init__(self, store: StoreClient, beat_store: StoreClient, node: int, nnodes: int) -> None:
        self._store, self._beat_store = store, beat_store
        self.meanwhile: Meanwhile = idle
        """What the main thread does while it waits for the store (the supervisor sets it)."""
        self.node, self.nnodes = node, nnodes
        self.host = socket.gethostname()
        self._prefix = "lockstep/attempt0/"
        self.attempt = 0
        """The attempt this launcher last joined."""
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_alive: dict[int, float] = {}
        """Wall-clock time each node was last seen beating: a lost node failed then, before the
        ranks that broke because of it."""
        self._stop = threading.Event()  # each beat thread has its own
        self._beater: threading.Thread | None = None
        self.without: list[int] = []
        """The nodes the attempt started without (an elastic job), which join the running job."""

    @classmethod
    def connect(cls, host: str, port: int, node: int, nnodes: int, server: Any = None) -> JobChannel:
        """Clients of the store at host:port (``server``: the store object this launcher hosts).
        They speak c10d's protocol themselves (:mod:`wire_store`), so that a launcher whose node
        hosts no store never imports torch; torch's client where the server speaks another one."""

        def client() -> Any:
            return wire_store.connect(host, port, CALL_S, lambda: tcp_store()(
                host, port, None, False, datetime.timedelta(seconds=CALL_S)))

        where = f"{host}:{port}"
        return cls(StoreClient((lambda: server) if server is not None else client, where),
                   StoreClient(client, where), node, nnodes)

    def last_answer(self) -> float:
        """Wall-clock time the store last answered this launcher."""
        return max(self._store.last_answer, self._beat_store.last_answer)

    # -- attempts -----------------------------------------------------------------------------

    def begin(self, attempt: int, timeout: float, tell: Callable[[str], None] | None = None, *,
              enough: Callable[[int], bool] | None = None, last_call: float = 0.0) -> list[int]:
        """Join ``attempt`` and wait for every node (up to ``timeout`` s); the nodes missing, if any.
        Every :data:`~lockstep.launcher.rendezvous.TELL_S` seconds ``tell`` gets a line naming them.

        An elastic job may start without some nodes (:attr:`without`): on the master's launcher,
        once ``enough(nodes joined)``, it waits ``last_call`` seconds more for the others, then
        starts without them (their ``alive`` and ``stage`` keys made, so that every counter
        exists); the other launchers follow its decision, and one it started without joins the
        running job instead."""
        self._stop_beating()
        self._prefix, self.attempt = f"lockstep/attempt{attempt}/", attempt
        self._seen.clear()
        self._last_alive = dict.fromkeys(range(self.nnodes), time.time())
        self.without = []
        self._call("set", self._key(f"joined{self.node}"), "1")
        self._call("set", self._key(f"stage{self.node}"), str(_RUNNING))
        self._call("add", self._key(f"alive{self.node}"), 1)  # every counter exists once all joined
        self._call("add", self._key("joined"), 1)
        missing = self._wait_for_nodes(attempt, timeout, tell, enough, last_call)
        if missing or self.node in self.without:
            return missing
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beat, args=(self._stop,), name="lockstep-beat", daemon=True)
        self._beater.start()
        return []

    def _wait_for_nodes(self, attempt: int, timeout: float, tell: Callable[[str], None] | None,
                        enough: Callable[[int], bool] | None, last_call: float) -> list[int]:
        """Until every node joined ``attempt`` or the attempt started without some (the master's
        decision, in :attr:`without`); the nodes missing at ``timeout``."""
        start = time.monotonic()
        deadline, told, call_ends = start + timeout, start, None
        while True:
            if self._call("check", [self._key("without")]):  # first: a node late for it counts in ``joined`` too
                self.without = json.loads(self._call("get", self._key("without")))
                return []
            joined = int(self._call("add", self._key("joined"), 0))
            if joined >= self.nnodes:
                return []
            if enough is not None and call_ends is None and enough(joined):
                call_ends = time.monotonic() + last_call
                if tell is not None:
                    tell(f"{joined} of {self.nnodes} nodes joined attempt {attempt}, enough to start (--nnodes "
                         f"MIN:MAX): waiting {last_call:g} s more for node(s) {', '.join(map(str, self._not_joined()))} "
                         f"(--rdzv_last_call)")
            if call_ends is not None and time.monotonic() >= call_ends:
                self._start_without(self._not_joined())
                return []
            if time.monotonic() > deadline:
                return self._not_joined()
            if tell is not None and time.monotonic() - told >= TELL_S:
                told = time.monotonic()
                tell(f"waiting for node(s) {', '.join(map(str, self._not_joined()))} to join attempt {attempt} "
                     f"at {self._store.where}: {told - start:.0f} s of {timeout:g} s (--rdzv_timeout)")
            self._pause(BEAT_S)

    def _start_without(self, nodes: list[int]) -> None:
        """The master's decision: the attempt starts without ``nodes``, whose counters it makes."""
        for n in nodes:
            self._call("add", self._key(f"alive{n}"), 0)
            self._call("compare_set", self._key(f"stage{n}"), "", str(_RUNNING))
        self.without = nodes
        self._call("set", self._key("without"), json.dumps(nodes))

    def rejoin(self, attempt: int) -> None:
        """Take part again in the running ``attempt``, which went on without this node (an elastic
        job; the master lets its ranks back in): beat at once, so that the master does not count
        this node lost again while it asks to join."""
        self._stop_beating()
        self._prefix, self.attempt = f"lockstep/attempt{attempt}/", attempt
        self._seen.clear()
        self._last_alive = dict.fromkeys(range(self.nnodes), time.time())
        self._call("set", self._key(f"stage{self.node}"), str(_RUNNING))
        self._call("add", self._key(f"alive{self.node}"), 1)
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beat, args=(self._stop,), name="lockstep-beat", daemon=True)
        self._beater.start()

    def welcome(self, node: int) -> None:
        """Node ``node`` takes part again (an elastic job let its launcher, started again, back in):
        its silence is measured from now."""
        self._seen.pop(node, None)

    def master_attempt(self) -> int:
        """The attempt the master's launcher is in."""
        return int(self._call("get", ATTEMPT_KEY)) if self._call("check", [ATTEMPT_KEY]) else 0

    def _not_joined(self) -> list[int]:
        return [n for n in range(self.nnodes) if not self._call("check", [self._key(f"joined{n}")])]

    def _beat(self, stop: threading.Event) -> None:
        key = self._key(f"alive{self.node}")
        while not stop.is_set():
            try:
                self._beat_store.call("add", key, 1)
            except StoreLost:  # the main thread will see it too
                return
            stop.wait(BEAT_S)

    def _stop_beating(self) -> None:
        if self._beater is not None:
            # Not joined: a beat blocked by a partition may take until its deadline. The thread
            # stops at its next look at its own event, and it only ever beats its own attempt's key.
            self._stop.set()
            self._beater = None

    def close(self) -> None:
        self._stop_beating()

    def publish_attempt(self, attempt: int, restarts: int = 0) -> None:
        """The master's: it is beginning ``attempt`` (after :meth:`publish_port`, before :meth:`begin`),
        with ``restarts`` of ``--max_restarts`` used so far (a node that joins later counts as the others)."""
        self._call("set", f"lockstep/attempt{attempt}/restarts", str(restarts))
        self._call("set", ATTEMPT_KEY, str(attempt))

    def restarts(self, attempt: int) -> int:
        """The restarts of ``--max_restarts`` used before ``attempt`` (after :meth:`begin`)."""
        key = f"lockstep/attempt{attempt}/restarts"
        return int(self._call("get", key)) if self._call("check", [key]) else attempt

    def attempt_to_join(self, timeout: float, tell: Callable[[str], None] | None = None, *,
                        after: int = -1) -> int | None:
        """The attempt this node joins: the master's, unless this node (or a launcher it replaces)
        already took part in it or it is not after ``after``; then the master's next one, waited for
        up to ``timeout`` s (None if it does not begin by then). Every
        :data:`~lockstep.launcher.rendezvous.TELL_S` seconds ``tell`` gets a line."""
        start = told = time.monotonic()
        while True:
            master = self.master_attempt()
            if master > after and not self._call("check", [f"lockstep/attempt{master}/joined{self.node}"]):
                return master
            now = time.monotonic()
            if now - start > timeout:
                return None
            if tell is not None and now - told >= TELL_S:
                told = now
                tell(f"waiting for the master to begin the attempt after {master} at {self._store.where}: "
                     f"{now - start:.0f} s of {timeout:g} s (--rdzv_timeout)")
            self._pause(BEAT_S)

    def publish_port(self, attempt: int, port: int) -> None:
        """The master's: where the ranks of ``attempt`` find their store (before :meth:`begin`)."""
        self._call("set", f"lockstep/attempt{attempt}/port", str(port))

    def port(self, attempt: int) -> int:
        """The ranks' store port of ``attempt`` (after :meth:`begin`: the master set it before joining)."""
        return int(self._call("get", f"lockstep/attempt{attempt}/port"))

    # -- failures -----------------------------------------------------------------------------

    def report(self, failure: Failure, meanwhile: Meanwhile | None = None) -> None:
        """Record ``failure`` for every node (``meanwhile``: what the wait does instead of :attr:`meanwhile`,
        ``idle`` on a thread other than the main one)."""
        self._call("append", self._key("failures"), failure.to_json() + "\n", meanwhile=meanwhile)
        self._call("add", self._key("failed"), 1, meanwhile=meanwhile)

    def done_reporting(self, meanwhile: Meanwhile | None = None) -> None:
        """This node has recorded every failure it will: deciders need not wait for it."""
        self._call("set", self._key(f"stage{self.node}"), str(_REPORTED), meanwhile=meanwhile)

    def leave(self) -> None:
        """This node is done with the store (it will not restart)."""
        self._call("set", self._key(f"stage{self.node}"), str(_LEFT))

    def any_failed(self) -> bool:
        return self._call("add", self._key("failed"), 0) > 0

    def stall_reported(self) -> bool:
        """Whether a node recorded a stall."""
        return any(f.cause in STALLS for f in self._failures())

    def _counts(self) -> tuple[list[int], list[int]]:
        """Every node's ``alive`` counter and stage, in one round trip (each exists once all joined)."""
        keys = [self._key(f"{name}{n}") for name in ("alive", "stage") for n in range(self.nnodes)]
        values = [int(v) for v in self._call("multi_get", keys)]
        return values[:self.nnodes], values[self.nnodes:]

    def lost_nodes(self, counts: tuple[list[int], list[int]] | None = None) -> list[Failure]:
        """Nodes whose launcher stopped beating, and are neither done nor gone."""
        now = time.monotonic()
        lost = []
        alive, stage = counts or self._counts()
        for n, count in enumerate(alive):
            if n == self.node or count >= DONE or stage[n] == _LEFT:
                continue
            last_count, since = self._seen.get(n, (-1, now))
            if count != last_count:
                self._seen[n] = (count, now)
                self._last_alive[n] = time.time()
            elif now - since >= LOST_AFTER_S:
                lost.append(Failure(n, "?", -1, LOST_EXIT_CODE, self._last_alive[n], cause=LOST))
        return lost

    def _joined_counts(self) -> tuple[list[int], list[int]]:
        """As :meth:`_counts`, where a node may not have joined this attempt (the job stopped
        during the rendezvous): such a node counts as done, having nothing to wait for, and no
        key of it is read (a read of a key that no one set waits for the call's whole deadline)."""
        every = [self._key(f"alive{n}") for n in range(self.nnodes)]
        if self._call("check", every):
            return self._counts()
        joined = [n for n in range(self.nnodes) if self._call("check", [every[n]])]
        keys = [self._key(f"{name}{n}") for name in ("alive", "stage") for n in joined]
        values = [int(v) for v in self._call("multi_get", keys)] if keys else []
        alive, stage = [DONE] * self.nnodes, [_LEFT] * self.nnodes
        for i, n in enumerate(joined):
            alive[n], stage[n] = values[i], values[len(joined) + i]
        return alive, stage

    def others_gone(self) -> bool:
        """Whether every other node left, finished or is lost: node 0 may close the store."""
        return not self._still_here()

    def rejoining(self, let_go: set[int] | frozenset[int]) -> list[int]:
        """The nodes of ``let_go`` (an elastic job went on or started without them) whose launcher,
        started again, takes part in this attempt: it has neither left, finished nor stopped beating."""
        return sorted(set(self._still_here()) & set(let_go))

    def _still_here(self) -> list[int]:
        """The other nodes that have neither left, finished nor stopped beating."""
        counts = self._joined_counts()
        lost = {f.node for f in self.lost_nodes(counts)}
        alive, stage = counts
        return [n for n in range(self.nnodes)
                if n != self.node and stage[n] != _LEFT and alive[n] < DONE and n not in lost]

    def decide(self, let_go: set[int] | frozenset[int] = frozenset()) -> Failure:
        """The agreed root cause (call once a failure is known): wait until every other node has
        reported or is lost, then the root cause of every failure recorded, as the first decider set
        it. ``let_go``: the nodes an elastic job went on (or started) without, never a cause."""
        self.done_reporting()
        lost = self._await_reports(let_go)
        verdict = self._verdict()
        if verdict is None:
            first = root_cause(self._failures() + lost)
            verdict = Failure.from_json(self._call("compare_set", self._key("verdict"), "",
                                                   first.to_json()).decode())
        return verdict

    def _await_reports(self, let_go: set[int] | frozenset[int]) -> list[Failure]:
        """Wait until no other node may still record a failure (or a verdict exists); the lost ones."""
        start = time.monotonic()
        alive, _ = self._counts()
        pending = {n: (alive[n], start) for n in range(self.nnodes) if n != self.node and n not in let_go}
        lost: list[Failure] = []
        while pending and self._verdict() is None:
            self._pause(BEAT_S)
            now = time.monotonic()
            alive, stage = self._counts()
            for n, (count, since) in list(pending.items()):
                if alive[n] != count:
                    pending[n], since = (alive[n], now), now
                    self._last_alive[n] = time.time()
                if alive[n] >= DONE or stage[n] != _RUNNING or now - start >= _SILENT_S:
                    del pending[n]
                elif now - since >= LOST_AFTER_S:
                    del pending[n]
                    lost.append(Failure(n, "?", -1, LOST_EXIT_CODE, self._last_alive.get(n, 0.0), cause=LOST))
        return lost

    def _verdict(self) -> Failure | None:
        if self._call("check", [self._key("verdict")]):
            return Failure.from_json(self._call("get", self._key("verdict")).decode())
        return None

    def _failures(self) -> list[Failure]:
        if not self._call("check", [self._key("failures")]):
            return []
        text = self._call("get", self._key("failures")).decode()
        return [Failure.from_json(line) for line in text.splitlines() if line.strip()]

    # -- success ------------------------------------------------------------------------------

    def finish(self) -> None:
        self._call("add", self._key(f"alive{self.node}"), DONE)

    def all_done(self, let_go: set[int] | frozenset[int] = frozenset()) -> bool:
        """Whether every node's ranks finished (but the nodes an elastic job went on without)."""
        return all(count >= DONE or n in let_go for n, count in enumerate(self._counts()[0]))

    def _key(self, name: str) -> str:
        return self._prefix + name

    def call(self, name: str, *args: Any) -> Any:
        """A call of the store (its deadline, the main thread's other work meanwhile), for what
        shares the store with the agreement: an elastic job's membership."""
        return self._call(name, *args)

    def _call(self, name: str, *args: Any, meanwhile: Meanwhile | None = None) -> Any:
        return self._store.call(name, *args, meanwhile=meanwhile or self.meanwhile)

    def pause(self, seconds: float) -> None:
        """Wait ``seconds``, doing the main thread's other work meanwhile."""
        self._pause(seconds)

    def _pause(self, seconds: float) -> None:
        """Wait between polls of the store, doing the main thread's other work meanwhile."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            self.meanwhile(remaining)
