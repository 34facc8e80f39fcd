"""The ranks' side of an elastic job's membership: which ranks train now, and a new process group
among them after one was lost.

The launcher hosts the job's store and, when a rank is lost while at least ``--min_ranks`` live,
publishes the next generation of the membership under ``LOCKSTEP_ELASTIC`` (a store key prefix):
``<prefix>generation`` counts the generations, ``<prefix>members<g>`` lists generation g's ranks
by the rank each had at launch. A thread of each rank watches the count. While the membership
holds, the collectives of :mod:`lockstep.dist` are waited for by polling them, so that a change
ends the wait at once with :class:`MembershipChanged` (a wait inside gloo would block for as long
as its timeout on a peer that another survivor stopped talking to). :meth:`Membership.reform`
then replaces the default process group by one of the new generation's ranks.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as torch_dist

from lockstep import dist, regroup
from lockstep.launcher.elastic_names import ELASTIC_ENV, generation_key, joined_key

_POLL_S = 0.05
_CHANGE_WAIT_S = 60.0
"""How long a rank whose collective failed waits for the launcher to publish the change."""


class MembershipChanged(RuntimeError):
    """The ranks that train changed while this rank waited in a collective; the step in flight
    is abandoned (:meth:`Membership.reform` makes the new process group)."""


class Membership:
    """This rank's view of the membership: ``generation`` is the one its process group was made
    for; a watcher thread reads the newest one from the launcher's store."""

    def __init__(self, prefix: str, launch_rank: int, timeout: float = 300.0) -> None:
        self.prefix, self.launch_rank, self.timeout = prefix, launch_rank, timeout
        self._store = regroup.client()
        self.generation = 0
        self.ranks = list(range(torch_dist.get_world_size()))  # the launch ranks that train now
        self.before: list[int] | None = None
        """The ranks that trained before this rank joined the running job (None: it trained from the launch)."""
        if regroup.entered is not None:  # this rank joined a running job, or started in a smaller one
            self.generation, self.ranks = regroup.entered  # (lockstep.dist.initialize_dist)
            if not regroup.started:
                self.before = regroup.members(self._store, prefix, self.generation - 1)
        self.fresh = self.before is not None
        self._per_node = int(os.environ.get("LOCAL_WORLD_SIZE", len(self.ranks)))  # at launch
        self._tell_local_world()
        """Whether this rank joined the running job and has yet to take a peer's state (``catch_up``)."""
        self._newest = self.generation
        self._points: dict[int, int] = {}  # per generation, how many times its ranks met in all_or_none
        self._store.add(joined_key(prefix), 1)  # the launcher shrinks only a job whose every rank follows
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="lockstep-membership", daemon=True)
        self._watcher.start()
        # A daemon thread that is inside a store call when the interpreter finalizes is unwound
        # through C++ frames that cannot be (std::terminate, SIGABRT): it stops before that.
        atexit.register(self.stop_watching)

    def _watch(self) -> None:
        store = regroup.client()  # a store client is not shared between threads
        key = generation_key(self.prefix)
        while not self._done.is_set():
            try:
                self._newest = max(self._newest, int(store.add(key, 0)))
            except Exception:  # noqa: BLE001 - the launcher went away: the job is ending
                return
            self._done.wait(_POLL_S)

    def stop_watching(self) -> None:
        """End the watcher thread (at exit)."""
        self._done.set()
        self._watcher.join(timeout=5)

    def _node_ranks(self) -> list[int]:
        """The launch ranks of this rank's node that train now."""
        node = self.launch_rank // self._per_node
        return [r for r in self.ranks if r // self._per_node == node]

    def _tell_local_world(self) -> None:
        dist.set_local_world_size(len(self._node_ranks()) if self.generation else None)

    def leads_node(self) -> bool:
        """Whether this rank is its node's lowest rank that trains now (the one that speaks for it)."""
        return min(self._node_ranks()) == self.launch_rank

    def share(self, name: str, value: str) -> None:
        """Keep ``value`` for a rank that joins the running job later (:meth:`shared`): what the
        ranks agreed on at the start by a collective it was not part of, such as a made-up run name."""
        self._store.set(f"{self.prefix}shared/{name}", value)

    def shared(self, name: str) -> str:
        """What :meth:`share` kept under ``name`` (a rank that joined the running job)."""
        return self._store.get(f"{self.prefix}shared/{name}").decode()

    def caught_up(self) -> None:
        """This rank follows the newest change (a rank that joined has taken a peer's state): it
        trains as the others do. Counted for the launcher, which lets a rank started again in place
        in only once every rank has (``g<generation>/settled``)."""
        self.fresh, self.before = False, None
        self._store.add(f"{self.prefix}g{self.generation}/settled", 1)

    def changed(self) -> bool:
        return self._newest > self.generation

    def check(self) -> None:
        """:class:`MembershipChanged` if the membership changed: what a wait that polls a
        collective itself calls between polls (those of ``lockstep._agreement``)."""
        if self.changed():
            raise MembershipChanged(f"the job's ranks changed (generation {self._newest})")

    def wait(self, work: Any) -> None:
        """Wait for a collective's ``work``, polling it: :class:`MembershipChanged` as soon as the
        membership changes, or when the collective failed (a peer died) and the launcher
        publishes the change within a minute (else the collective's own error)."""
        pause = 0.0002
        while not work.is_completed():
            self.check()
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        try:
            work.wait()
        except RuntimeError as error:
            if self.follows(error):
                raise MembershipChanged(f"a collective failed as the job's ranks changed: {error}") from None
            raise

    def follows(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a collective (one that torch waited for itself, such as a
        metric's gather), came from a change of the job's ranks: a connection to a peer that
        broke, and the launcher publishing a change within a minute."""
        text = str(error)
        if not (isinstance(error, torch_dist.DistError) or "gloo" in text or "Connection" in text):
            return False
        deadline = time.monotonic() + _CHANGE_WAIT_S
        while not self.changed() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return self.changed()

    def all_or_none(self, what: str) -> None:
        """Return once every rank of this generation got here; :class:`MembershipChanged` on every
        one of them if the membership changes first, decided once for all (a compare-and-set in
        the store). For what comes after a waited collective that some ranks may have completed
        while another gave it up, having seen a change first (its part was sent already): torch's
        own collectives after it, such as making a process group or FSDP's gathers, would wait for
        that rank for their whole timeout, unpolled. ``what``: what comes next, for the error."""
        point = self._points[self.generation] = self._points.get(self.generation, 0) + 1
        key = f"{self.prefix}g{self.generation}/point{point}/"
        if int(self._store.add(key + "arrived", 1)) >= len(self.ranks):
            self._store.compare_set(key + "decided", "", "go")
        pause = 0.0005
        while not self._store.check([key + "decided"]):
            if self.changed():
                self._store.compare_set(key + "decided", "", "stop")
                break
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S)
        if self._store.get(key + "decided") != b"go":
            raise MembershipChanged(f"the job's ranks changed (generation {self._newest}) before every rank "
                                    f"reached {what}")

    def reform(self) -> None:
        """A process group of the newest generation's ranks in place of the default one (this
        rank's new rank and the world size are then the group's; ``ranks`` its launch ranks). The
        old group is left to its threads (one may still wait on a peer that is gone): destroying it
        could wait for them. A rank of the new generation lost before it arrives makes the launcher
        publish another one, which the others then form instead of waiting for the lost rank.
        Nothing happens where the group is the newest generation's already (a rank that joined)."""
        if regroup.newest(self._store, self.prefix) == self.generation:
            return
        _abandon_groups()
        # torch wraps the hook at each init_process_group ("[rankN]: " before each line of a traceback):
        # keep the first, whose N names the rank's log file when it started with the job
        hook = sys.excepthook
        try:
            self.generation, self.ranks = regroup.form(self._store, self.prefix, self.launch_rank, self.timeout,
                                                       lambda: self._newest)  # the watcher reads the counter
        finally:
            sys.excepthook = hook
        self._tell_local_world()


def _abandon_groups() -> None:
    """Take the default group, and every group made from it, out of torch's registry without
    shutting any down, and never free them: gloo's shutdown, as its destructor, joins the group's
    worker threads, and one of them may wait on a peer that is gone, or that left the group too,
    for the whole timeout. A library's own group (DeepSpeed's copy of the world) would otherwise be
    destroyed once the library lets it go, at whatever collection of garbage frees it, and that
    rank would wait there. Each change of the job's ranks leaks these groups, their threads and
    their sockets, until the process ends."""
    for group in {torch_dist.group.WORLD, *torch_dist.distributed_c10d._world.pg_map}:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never freed, so never destroyed
    shutdown = torch_dist.ProcessGroup.__dict__["shutdown"]  # the descriptor itself, to put back as it was
    torch_dist.ProcessGroup.shutdown = lambda self: None  # type: ignore[method-assign]
    try:
        torch_dist.destroy_process_group()
    finally:
        setattr(torch_dist.ProcessGroup, "shutdown", shutdown)


_membership: Membership | None = None


def join(timeout: float = 300.0) -> Membership | None:
    """This rank's membership in an elastic job (made once, after the process group); None when
    the job is not elastic. From then on :mod:`lockstep.dist`'s collectives wait through it."""
    global _membership
    prefix = os.environ.get(ELASTIC_ENV)
    if not prefix or not torch_dist.is_initialized():
        return None
    if _membership is None:
        _membership = Membership(prefix, int(os.environ["RANK"]), timeout)
        dist.set_collective_waiter(_membership.wait, _membership.check)
    return _membership


def current() -> Membership | None:
    """This rank's membership, once :func:`join` made it; None outside an elastic job."""
    return _membership
