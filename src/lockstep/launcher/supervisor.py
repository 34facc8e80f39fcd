"""Supervisor: start this node's ranks, watch them, report, restart.

With ``ranks`` (a rank's process) and ``stopping`` (the launcher's signals, the teardown), the only
module of the launcher that touches processes, sockets and signals. Each rank leads a process group
of its own; the launcher is a child subreaper, so whatever a rank starts stays below it whatever its
group or session, and the watchdog kills all of it (:mod:`tree`) if the launcher itself is killed.

SIGQUIT prints every rank's stacks and the job goes on. The ranks' progress slots and stack files
live in a node-local control folder that exists while the launcher runs. On several nodes, a
stopping signal is recorded for the other nodes as the cause of the job's end, and a stall found on
any node makes every node print its own ranks' stacks.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.launcher import resolver
from lockstep.launcher.elastic_names import JOIN_ENV, RESTART, START_ENV
from lockstep.launcher.in_place import InPlace
from lockstep.launcher.interface import interface_env
from lockstep.launcher.membership import Members, admission, ask_master, ask_to_join, was_let_go, withdraw
from lockstep.launcher.job import BEAT_S, ECHOED, EXITED, GROWING, LOST_EXIT_CODE, SIGNALLED, Failure, JobChannel
from lockstep.launcher.output import open_logs, prepare_run_directory
from lockstep.launcher.plan import LaunchError, LaunchPlan, Mode
from lockstep.launcher.prefork import PreforkServer, command_forkable, preload_list
from lockstep.launcher.ranks import Rank, Waiter, no_terminal_stops, spawn
from lockstep.launcher.rendezvous import StoreState, describe, wait_for_store
from lockstep.launcher.report import (
    describe_exit,
    failure_tail,
    report_failure,
    report_verdict,
    say,
    shell_code,
    show_cause,
)
from lockstep.launcher.stacks import Stacks, collect, format_stacks, stacks_path
from lockstep.launcher.stall import STALL_EXIT_CODE, ProgressBoard, diagnose, stall_failures
from lockstep.launcher.store import (
    Meanwhile,
    Stopped,
    StoreLost,
    host_store,
    idle,
    own_address,
)
from lockstep.launcher.stopping import (
    HANDLED,
    PASSED_ON,
    STOPPING,
    caught_signals,
    forward,
    pass_on,
    signalled_code,
    teardown,
)
from lockstep.launcher.tree import Reaper, become_subreaper, marked, new_mark
from lockstep.launcher.watchdog import Watchdog
from lockstep.progress import CONTROL_DIR_ENV

__all__ = ["Supervisor", "describe_exit", "shell_code"]

_STALL_POLL_S = 1.0
_LIVENESS_EVERY_S = 1.0
_DEPARTURE_S = 20.0  # beyond the grace period: node 0 keeps the store up this long for the others
_ECHO_WAIT_S = 5.0  # how long a rank that raised another's error waits for that rank to be named
_ECHO_POLL_S = 0.05


@dataclass
class _Failure:
    rank: Rank
    code: int


@dataclass
class _Stall:
    ranks: list[Rank]


@dataclass
class _Elsewhere:
    """Another node reported a failure, or a node stopped answering."""


@dataclass
class _Refused:
    """This node's ranks do not join the running elastic job: the master's launcher refused, or a
    rank failed before it let them in (``code``: the launcher's exit code)."""

    code: int


@dataclass
class _Rejoin:
    """This node's ranks join the job at its next attempt: the running job's ranks follow no change
    of the membership (a torchrun script), so every node starts its ranks again with this one's."""


class Supervisor:
    """Runs one LaunchPlan to completion and returns the launcher's exit code."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self._signals_seen: list[int] = []
        self._control_dir = Path()
        self._board: ProgressBoard | None = None
        self._next_liveness_check = 0.0
        self._attempt_store: Any = None
        self._interface: dict[str, str] = {}
        self._wake_r = -1
        self._ranks: list[Rank] = []
        self._echoes: list[tuple[Rank, float]] = []
        """Ranks that failed with another live rank's error, each with the time to stop waiting for it."""
        """This attempt's ranks, for :meth:`_meanwhile`."""
        self._stashed: tuple[list[int], list[Rank]] = ([], [])
        """Signals and rank exits :meth:`_meanwhile` saw, for the monitor to act on."""
        self._channel: JobChannel | None = None
        self._mark = ""
        """What every rank's environment carries so that the watchdog finds the job (:mod:`tree`)."""
        self._reaper = Reaper(lambda: ())
        self._store_host = plan.master_addr
        """Where this launcher reaches the job's store: the master's address, or its own on the master."""
        self._signal_recorded = False
        """Whether this launcher recorded (or began to record) a stopping signal for the other nodes."""
        self._launcher_store: Any = None
        self._launcher_port = 0
        """The port of the store this launcher hosts (0: it hosts none)."""
        self._members: Members | None = None
        """An elastic attempt's membership (--min_ranks), kept by the launcher that hosts the store."""
        self._let_go: set[int] = set()
        """The nodes an elastic attempt went on without (the master's launcher)."""
        self._rejoining = False
        """Whether this launcher, started again for a node the running elastic job went on
        without, asks to join it and was not let in yet: not one of the job's nodes."""
        self._request: str | None = None
        """Its request to join (the token its ranks carry), until the master's launcher answers."""
        self._rejoin_after: int | None = None
        """The attempt this launcher asked to join and was answered :data:`RESTART`: it takes part in
        the master's next one."""
        self._restarts = 0
        """The restarts of ``--max_restarts`` used (a restart to let a node in counts none)."""
        self._joiners: set[int] = set()
        """The nodes the master's launcher starts every rank again for, to let them in."""
        self._prefork: PreforkServer | None = None
        self._prefork_refused = False
        self._in_place = InPlace(plan.rank_restarts)
        self._subreaper = False

    def run(self) -> int:
        listener = self._bind_store_socket() if self.plan.hosts_store else None
        if isinstance(listener, int):
            return listener  # a usage error, already reported
        port = listener.getsockname()[1] if listener else self.plan.master_port
        watchdog = Watchdog(new_mark())  # forked first, so it inherits no handlers and no wakeup pipe
        self._mark = watchdog.mark
        self._subreaper = become_subreaper()  # not inherited by the watchdog (fork) nor by the ranks
        self._reaper = Reaper(lambda: {watchdog.pid, *(r.proc.pid for r in self._ranks)})
        with caught_signals() as wake_r, no_terminal_stops(), self._reaper:
            self._wake_r = wake_r
            shm = Path("/dev/shm")
            self._control_dir = Path(tempfile.mkdtemp(
                prefix="lockstep-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
            watchdog.remove_at_death(str(self._control_dir))
            try:
                launcher_store = self._launchers_store(listener)
                if self.plan.is_multinode:
                    self._interface, line = interface_env(self.plan.master_addr, os.environ,
                                                          lambda: self._stopping(wake_r))
                    if self.plan.verbose:
                        say(line)
                    if self._signals_seen:  # it came during the lookup, which gave up at once
                        say(f"received {signal.Signals(self._signals_seen[0]).name} while looking up the master")
                        return 128 + self._signals_seen[0]
                    self._store_host = own_address(listener) if listener else self.plan.master_addr
                    joined = self._join_job(port, launcher_store, wake_r)
                    if isinstance(joined, int):
                        return joined
                return self._run_attempts(port, listener, wake_r, watchdog, launcher_store is None)
            except LaunchError as e:
                say(f"error: {e}")
                return 2
            finally:
                self._release(watchdog, listener)

    def _release(self, watchdog: Watchdog, listener: socket.socket | None) -> None:
        """What the launcher holds, at its end: the store's connections and the stores it serves,
        the progress board, the control folder, the prefork server, the watchdog, the store port."""
        for held in (self._channel, self._board, self._attempt_store, self._launcher_store):
            if held is not None:
                held.close()
        watchdog.remove_at_death(None)  # before the folder's name is free for another launcher's
        shutil.rmtree(self._control_dir, ignore_errors=True)
        if self._prefork is not None:
            self._prefork.close()
        watchdog.close()
        if listener:
            listener.close()

    def _launchers_store(self, listener: socket.socket | None) -> Any:
        """The store this launcher hosts, or None where rank 0 hosts it. On several nodes the store
        must outlive ranks and restarts, and in an elastic job any rank, rank 0 too: this launcher
        hosts it (served in the standard library: no torch in the launcher)."""
        plan = self.plan
        if not listener or not (plan.mode is Mode.COMMAND or plan.is_multinode or plan.min_ranks):
            return None
        self._launcher_store = host_store(listener)
        self._launcher_port = listener.getsockname()[1]
        return self._launcher_store

    def _join_job(self, port: int, launcher_store: Any, wake_r: int) -> JobChannel | int:
        """Connect this node's launcher to the others through the store (the exit code if not)."""
        if not self.plan.hosts_store:
            code = self._await_store(port, wake_r)
            if code is not None:
                return code
        channel = JobChannel.connect(self._store_host, port, self.plan.node_rank,
                                     self.plan.group_world_size, server=launcher_store)
        channel.meanwhile = self._meanwhile
        self._channel = channel
        return channel

    def _run_attempts(self, port: int, listener, wake_r: int, watchdog: Watchdog, pass_fd: bool) -> int:
        attempt = 0
        while True:
            if not self.plan.hosts_store and self._channel is None:
                # multi-node: rejoin the master after it was lost (it may still be cut off)
                joined = self._join_job(port, None, wake_r) if self.plan.is_multinode else \
                    self._await_store(port, wake_r)
                if isinstance(joined, int):
                    return joined
            code, attempt = self._attempt(attempt, port, listener if pass_fd else None, wake_r, watchdog)
            if code is not None:
                return code
            attempt += 1

    def _attempt(self, attempt: int, port: int, listener, wake_r: int, watchdog: Watchdog) -> tuple[int | None, int]:
        """Run one attempt (on another node than the master's: the master's, which may not be
        ``attempt``); the exit code or None to restart, and the attempt that ran."""
        channel = self._channel
        ranks: list[Rank] = []
        self._ranks, self._stashed = ranks, ([], [])  # nothing of an earlier attempt carries over
        rank_port: int | None = port
        try:
            if channel is not None:
                begun = self._begin_attempt(channel, attempt, port)
                if begun is None:
                    return LOST_EXIT_CODE, attempt
                attempt, rank_port = begun
            elif attempt and self._launcher_store is not None:
                rank_port = self._fresh_attempt_store()
            self._keep_membership(channel, attempt)
            ranks = self._spawn_all(rank_port, attempt, listener.fileno() if listener else None, watchdog)
            self._ranks = ranks
            outcome = self._monitor(ranks, wake_r, channel)
            if outcome is None and channel is not None:
                outcome = self._finish_job(ranks, wake_r, channel)
            if outcome is None:
                self._teardown(ranks, wake_r, watchdog, signal.SIGTERM)
                return 0, attempt
            if isinstance(outcome, (_Refused, _Rejoin)):  # not one of the job's nodes (yet): nothing to report
                assert channel is not None
                self._teardown(ranks, wake_r, watchdog, signal.SIGTERM)
                if isinstance(outcome, _Rejoin):  # one of them from the master's next attempt
                    self._rejoin_after = attempt
                    return None, attempt
                self._leave(channel, wake_r)
                return outcome.code, attempt
            if isinstance(outcome, int):  # the launcher was signalled
                self._teardown(ranks, wake_r, watchdog, None)
                code = signalled_code(ranks, outcome)
                if channel is not None:
                    self._leave(channel, wake_r)
                return code, attempt
            if channel is not None:
                return self._settle_across_nodes(channel, attempt, ranks, wake_r, watchdog), attempt
        except Stopped as e:  # while waiting for the store: the signal went on to the ranks already
            return self._stopped_while_waiting(e.signum, wake_r, watchdog), attempt
        except StoreLost as e:
            self._teardown(self._ranks, wake_r, watchdog, signal.SIGTERM)  # their last words, then the verdict
            return self._lost_master(port, str(e), attempt), attempt
        return self._settle_here(outcome, attempt, ranks, wake_r, watchdog), attempt

    def _fresh_attempt_store(self) -> int:
        """A restart's ranks rendezvous in a store of their own, whose port this returns, where
        this launcher hosts the job's store (on several nodes, and on one for a command or an
        elastic job); the membership stays in the launcher's."""
        if self._attempt_store is not None:
            self._attempt_store.close()
        self._attempt_store = host_store()
        return int(self._attempt_store.port)

    def _keep_membership(self, channel: JobChannel | None, attempt: int) -> None:
        """On the master's launcher of an elastic job: the attempt's membership, published before
        its ranks start (without the nodes the attempt started without, which are let go)."""
        self._members, self._let_go = None, set()
        if not (self.plan.min_ranks and self.plan.hosts_store):
            return
        self._members = Members(self._launcher_store, attempt, list(range(self.plan.world_size)),
                                self.plan.min_ranks, self.plan.nproc)
        if channel is not None and channel.without:  # before its ranks form the first generation
            self._members.start_without(channel.without, self.plan.rdzv_last_call)
            self._let_go.update(channel.without)

    def _stopped_while_waiting(self, signum: int, wake_r: int, watchdog: Watchdog) -> int:
        """A stopping signal that came while the main thread waited for the store, and went on to
        the ranks: recorded for the other nodes, as any other, on a thread of its own while the
        ranks are torn down (the store may not answer, and the grace period is all there is);
        the launcher's exit code."""
        channel, recorded = self._channel, threading.Event()
        if self._rejoining:  # not one of the job's nodes: nothing to tell it (were its ranks let in
            channel = None  # meanwhile, the master finds this node lost, as any other)
        if channel is not None and not self._signal_recorded:
            def record() -> None:
                if self._record_signal(channel, signum, idle):
                    recorded.set()
            threading.Thread(target=record, name="lockstep-record", daemon=True).start()
        until = time.monotonic() + self.plan.grace_period
        self._teardown(self._ranks, wake_r, watchdog, None)
        code = signalled_code(self._ranks, signum)
        if channel is not None and recorded.wait(max(0.0, until - time.monotonic())):
            self._leave(channel, wake_r)  # the master keeps the store up until the others read it
        return code

    def _lost_master(self, port: int, why: str, attempt: int) -> int | None:
        """The store stopped answering (this node's ranks already stopped): say so, and since when;
        the exit code, or None to rejoin the master for the next attempt."""
        assert self._channel is not None
        since = self._channel.last_answer()
        self._channel.close()
        self._channel = None
        where = f"{self.plan.master_addr}:{port}"
        if self.plan.hosts_store:
            say(f"the job failed: this launcher's own rendezvous store at {where} stopped answering ({why})")
            return LOST_EXIT_CODE
        clock = time.strftime("%H:%M:%S", time.localtime(since))
        say(f"the job failed: the rendezvous store at {where}, which node 0's launcher hosts, stopped "
            f"answering ({why}): lost the master, silent since {clock} ({time.time() - since:.0f} s ago); "
            f"node 0 counts as failed")
        if self._signals_seen or self._restarts >= self.plan.max_restarts:
            return 128 + self._signals_seen[0] if self._signals_seen else LOST_EXIT_CODE
        self._restarts += 1
        say(f"restarting ({self._restarts} of {self.plan.max_restarts}): this node's ranks stopped, "
            f"rejoining the master at {where} for up to {self.plan.rdzv_timeout:g} s (--rdzv_timeout)")
        return None

    def _settle_across_nodes(self, channel: JobChannel, attempt: int, ranks: list[Rank], wake_r: int,
                             watchdog: Watchdog) -> int | None:
        """After a failure on several nodes: print the verdict every node agreed on; the exit code,
        or None to restart with the other nodes."""
        verdict = channel.decide(self._let_go)
        self._teardown(ranks, wake_r, watchdog, signal.SIGTERM)
        if verdict.cause == GROWING:
            say(f"node {verdict.node} asks to join, and the job's ranks follow no change of its ranks (a script "
                f"that forms its process group itself): every node starts its ranks again with node "
                f"{verdict.node}'s, as torchrun's agents do (no restart of --max_restarts is counted)")
            if not self._signals_seen:
                return None
            self._leave(channel, wake_r)
            return 128 + self._signals_seen[0]
        report_verdict(verdict, self.plan.node_rank)
        code = shell_code(verdict.code)
        if verdict.cause != SIGNALLED:  # as on the signalled node, a signal stops restarts
            code = self._after_failure(attempt, code, "every node's")
        if code is not None:
            self._leave(channel, wake_r)
        return code

    def _settle_here(self, outcome: _Failure | _Stall, attempt: int, ranks: list[Rank], wake_r: int,
                     watchdog: Watchdog) -> int | None:
        """After a rank failure or a stall on one node: report it; the exit code, or None to restart."""
        self._teardown(ranks, wake_r, watchdog, signal.SIGTERM)
        if isinstance(outcome, _Stall):
            return self._after_failure(attempt, STALL_EXIT_CODE, "this node's")
        others = [(o.spec.rank, o.returncode) for o in ranks if o is not outcome.rank]
        if report_failure(outcome.rank.spec, outcome.rank.proc.pid, outcome.code, others):
            return shell_code(outcome.code)  # a configuration error: a restart would meet it again
        return self._after_failure(attempt, shell_code(outcome.code), "this node's")

    def _begin_attempt(self, channel: JobChannel, attempt: int, port: int) -> tuple[int, int] | None:
        """Join an attempt with every node: ``attempt`` on the master's node, the master's on the
        others; that attempt and the port of its ranks' store (None: a node is missing).

        A restart's ranks rendezvous in a fresh store: torch's env:// rendezvous keeps no
        per-attempt prefix, so the old attempt's keys would mislead them."""
        if self.plan.hosts_store:
            if attempt:  # the previous attempt's store closes as this one replaces it
                channel.publish_port(attempt, self._fresh_attempt_store())
            channel.publish_attempt(attempt, self._restarts)
        else:
            after, self._rejoin_after = self._rejoin_after, None
            if self.plan.min_ranks and after is None:
                running = channel.master_attempt()
                if was_let_go(channel.call, running, self.plan.node_rank):
                    say(f"node {self.plan.node_rank}: the running job went on without this node; it asks to join, "
                        f"and its ranks start now and enter at a step boundary once the job lets them in")
                    return self._join_running(channel, running, port)
            followed = channel.attempt_to_join(self.plan.rdzv_timeout, tell=say, after=-1 if after is None else after)
            if followed is None:
                say(f"error: the master began no new attempt within {self.plan.rdzv_timeout:g} s (--rdzv_timeout): "
                    f"the job stops")
                return None
            attempt = followed
        missing = channel.begin(attempt, self.plan.rdzv_timeout, tell=say, enough=self._enough_nodes(),
                                last_call=self.plan.rdzv_last_call)
        self._joiners = set()
        if missing:
            say(f"error: node(s) {', '.join(map(str, missing))} did not join attempt {attempt} within "
                f"{self.plan.rdzv_timeout:g} s (--rdzv_timeout): the job stops")
            return None
        self._restarts = channel.restarts(attempt)
        if self.plan.node_rank in channel.without:  # the job started without this node: it joins
            say(f"node {self.plan.node_rank} joined attempt {attempt} after it started without it "
                f"(--rdzv_last_call): it joins the running job")
            return self._join_running(channel, attempt, port)
        return attempt, channel.port(attempt) if attempt else port

    def _enough_nodes(self) -> Callable[[int], bool] | None:
        """On the master's launcher of an elastic job: whether that many nodes may start the job.
        After a restart to let nodes in, not before as many as trained, and those, joined: else a
        node slower than ``--rdzv_last_call`` to follow would be left out again, and ask again."""
        if not (self.plan.min_ranks and self.plan.hosts_store):
            return None
        need = self.plan.group_world_size - len(self._let_go - self._joiners) if self._joiners else 0
        return lambda nodes: nodes * self.plan.nproc >= self.plan.min_ranks and nodes >= need

    def _join_running(self, channel: JobChannel, attempt: int, port: int) -> tuple[int, int]:
        """A launcher started again for a node that the running elastic ``attempt`` went on
        without: join that attempt, and ask the master's launcher to let this node's ranks back in
        once they are ready (:meth:`_answered` follows its answer). The attempt and its ranks' store port."""
        self._rejoining = True
        channel.rejoin(attempt)
        self._request = ask_to_join(channel.call, attempt, self.plan.node_rank)
        return attempt, channel.port(attempt) if attempt else port

    def _outside_the_job(self, channel: JobChannel, why: str) -> bool:
        """Whether this launcher is not one of the job's nodes (it asked to join, and was not let
        in): then its request is taken back (said here), and what happens to it is not the job's.
        False where the master's launcher let its ranks in first (they are the job's now)."""
        if not self._rejoining:
            return False
        if self._request is not None and not withdraw(channel.call, channel.attempt, self._request, why):
            return False
        self._rejoining, self._request = False, None
        say(f"node {self.plan.node_rank} does not join the running job: {why} before the job let its ranks in")
        return True

    def _answered(self, channel: JobChannel) -> _Refused | _Rejoin | None:
        """What the master's launcher answered this node's request to join the running job, once it
        did (said here): refused, or let in at the next attempt (a torchrun script's job); None
        while it waits, and once it let the ranks in (said once)."""
        if self._request is None or not self._rejoining:
            return None
        answer = admission(channel.call, channel.attempt, self._request)
        if answer is None:
            return None
        self._rejoining, self._request = False, None
        if answer == RESTART:
            say(f"node {self.plan.node_rank} joins the job as its ranks start again: they follow no change of "
                f"the job's ranks (a script that forms its process group itself), so every node starts them "
                f"again with this node's, as torchrun's agents do")
            return _Rejoin()
        if isinstance(answer, str):
            say(f"error: node {self.plan.node_rank} cannot join the running job ({answer}): this launcher stops")
            return _Refused(LOST_EXIT_CODE)
        say(f"node {self.plan.node_rank} joined the running job in generation {answer} of its ranks")
        return None

    def _leave(self, channel: JobChannel, wake_r: int) -> None:
        """Tell the other nodes that this one is done with the store. Node 0's launcher, which
        hosts it, keeps it up until the others are done too (or lost), so that none misses the
        verdict; a second stopping signal cuts that short."""
        try:
            if not self.plan.hosts_store:
                channel.leave()
                return
            deadline = time.monotonic() + self.plan.grace_period + _DEPARTURE_S
            with Waiter([], wake_r, HANDLED) as waiter:
                while not channel.others_gone() and time.monotonic() < deadline:
                    signals, _ = waiter.wait(BEAT_S)
                    if any(s in STOPPING for s in signals):
                        return
        except (StoreLost, Stopped):
            pass  # no one left to tell, or a second signal cut it short

    def _after_failure(self, attempt: int, code: int, whose: str) -> int | None:
        """The launcher's exit code after a failure, or None to restart (a signal stops restarts)."""
        if self._signals_seen:
            return 128 + self._signals_seen[0]
        if self._restarts < self.plan.max_restarts:
            self._restarts += 1
            say(f"restarting {whose} ranks ({self._restarts} of {self.plan.max_restarts})")
            return None
        return code

    # -- starting ---------------------------------------------------------------------------

    def _bind_store_socket(self) -> socket.socket | int:
        """Bind and listen on the store port now, and keep it: no one can take it before rank 0."""
        multinode = self.plan.is_multinode
        host = "" if multinode else self.plan.master_addr
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            # looked up here, with a deadline: bind() would ask the C library, for a minute and more
            # where the name server does not answer
            address = resolver.getaddrinfo(host, self.plan.master_port or 0, family, socket.SOCK_STREAM)[0][4] \
                if host else (host, self.plan.master_port or 0)
        except resolver.Unresolved as e:
            say(f"error: cannot bind the store port on the master's name {e}: pass --master_addr an "
                f"address, or a name this host resolves")
            return 2
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            sock.close()
            say(f"error: cannot bind the store port {self.plan.master_port} on {host or '*'} "
                f"({e.strerror}): pass another --master_port, or none on a single node")
            return 2
        sock.listen(max(128, self.plan.world_size))
        sock.set_inheritable(False)
        return sock

    def _stopping(self, wake_r: int) -> bool:
        """Whether a stop signal came (read off the wakeup pipe, kept in ``_signals_seen``)."""
        try:
            self._signals_seen.extend(s for s in os.read(wake_r, 64) if s in STOPPING)
        except BlockingIOError:
            pass
        return bool(self._signals_seen)

    def _await_store(self, port: int, wake_r: int) -> int | None:
        """On a node without rank 0: None once the master's store answers, else the exit code."""
        plan = self.plan
        if plan.verbose:
            say(f"waiting up to {plan.rdzv_timeout:g} s for the rendezvous store at {plan.master_addr}:{port}")

        state = wait_for_store(plan.master_addr, port, plan.rdzv_timeout, lambda: self._stopping(wake_r), tell=say)
        if state is StoreState.READY:
            return None
        if state is StoreState.INTERRUPTED:
            say(f"received {signal.Signals(self._signals_seen[0]).name} while waiting for the rendezvous store")
            return 128 + self._signals_seen[0]
        say(f"error: {describe(state, plan.master_addr, port, plan.rdzv_timeout)}")
        return 1

    def _spawn_all(self, port: int, attempt: int, store_fd: int | None, watchdog: Watchdog) -> list[Rank]:
        specs = prepare_run_directory(self.plan, attempt)
        logs = []
        try:
            for spec in specs:  # every file opens before any rank starts
                logs.append(open_logs(spec))
        except LaunchError:
            for opened in logs:
                opened.close()
            raise
        base_env = marked({k: v for k, v in os.environ.items() if k != "LOCKSTEP_STORE_FD"}, self._mark)
        base_env[CONTROL_DIR_ENV] = str(self._control_dir)
        base_env.update(self._interface)
        for spec in specs:
            stacks_path(self._control_dir, spec.rank).unlink(missing_ok=True)
        if self._board is not None:
            self._board.close()
        self._board = ProgressBoard(self._control_dir, [spec.rank for spec in specs])
        ranks: list[Rank] = []
        self._ranks = ranks  # each pid is in it before the reaper may collect an exit
        store_port = self._launcher_port if self._launcher_store is not None else None
        envs = [self.plan.worker_env(spec.local_rank, port, attempt, base_env, store_port, self._restarts)
                for spec in specs]
        self._in_place.remember(attempt, {spec.local_rank: env for spec, env in zip(specs, envs)}, watchdog)
        if self._request is not None:  # they enter the running job's ranks, not the launch's group
            for env in envs:
                env[JOIN_ENV] = self._request
        elif self._channel is not None and self._channel.without:  # the ranks there are form their group
            for env in envs:
                env[START_ENV] = "1"
        # the server imports with what every rank's environment shares: none of them is rank 0
        common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)} if envs else {}
        with self._reaper.starting():
            prefork = self._prefork_server(common, watchdog)
            for spec, rank_logs, env in zip(specs, logs, envs):
                pass_fds: tuple[int, ...] = ()
                if spec.local_rank == 0 and store_fd is not None:
                    env["LOCKSTEP_STORE_FD"] = str(store_fd)
                    pass_fds = (store_fd,)
                ranks.append(spawn(self.plan, spec, rank_logs, env, pass_fds, watchdog, prefork))
        if self.plan.verbose:
            for r in ranks:
                where = f"{r.spec.stdout_path or 'console'}, {r.spec.stderr_path or 'console'}"
                say(f"rank {r.spec.rank} (local {r.spec.local_rank}) pid {r.proc.pid} -> {where}")
        return ranks

    def _prefork_server(self, env: dict[str, str], watchdog: Watchdog) -> PreforkServer | None:
        """The server this attempt's ranks fork from (:mod:`prefork`): started on first use, and
        again only if it died; None where ranks start as fresh interpreters."""
        command = self.plan.command()
        preload = preload_list(os.environ, self.plan.target if self.plan.mode is Mode.SCRIPT else None)
        if self._prefork_refused or not self._subreaper or not command_forkable(command, self.plan.python) \
                or not preload:
            return None
        if self._prefork is None or not self._prefork.alive:
            if self._prefork is not None:
                self._prefork.close()
            self._prefork = PreforkServer(command, env, watchdog.write_fd, preload)
            self._prefork_refused = not self._prefork.usable  # torch did not import: not again
        return self._prefork if self._prefork.usable else None

    # -- watching -------------------------------------------------------------------------

    def _meanwhile(self, seconds: float) -> None:
        """While the main thread waits for the store: drain the ranks' output and catch signals,
        for up to ``seconds``. Rank exits and SIGQUIT are kept for the monitor; a stopping signal
        goes on to the ranks at once and abandons the wait (Stopped)."""
        with Waiter(self._ranks, self._wake_r, HANDLED) as waiter:
            signals, exited = waiter.wait(seconds)
        self._stashed[1].extend(exited)
        for signum in signals:
            if signum in STOPPING:
                if not self._signals_seen:
                    self._signals_seen.append(signum)
                    forward(self._ranks, signum)
                raise Stopped(signum)
            if signum in PASSED_ON:
                pass_on(self._ranks, signum)
            else:
                self._stashed[0].append(signum)

    def _unstash(self, signals: list[int], exited: list[Rank]) -> tuple[list[int], list[Rank]]:
        """What a wait returned, after what :meth:`_meanwhile` kept."""
        kept_signals, kept_exits = self._stashed
        self._stashed = ([], [])
        return kept_signals + signals, kept_exits + exited

    def _monitor(self, ranks: list[Rank], wake_r: int, channel: JobChannel | None = None
                 ) -> _Failure | _Stall | _Elsewhere | _Refused | _Rejoin | int | None:
        """Wait until every rank exited 0 (None), one failed (_Failure), the job stalled (_Stall),
        another node failed (_Elsewhere), this node may not join the running job (_Refused) or
        joins it at the next attempt (_Rejoin), or a stopping signal came (int)."""
        stall_timeout = self.plan.stall_timeout
        poll = BEAT_S if channel is not None else _STALL_POLL_S if stall_timeout else None
        self._echoes = []
        with Waiter(ranks, wake_r, HANDLED) as waiter:
            self._in_place.waiter = waiter
            while any(r.returncode is None for r in ranks) or self._stashed[1] or self._echoes:
                wait = 0 if any(self._stashed) else _ECHO_POLL_S if self._echoes and poll is None else poll
                if channel is None and self._members is not None and self.plan.rank_restarts:
                    wait = self._let_in(ranks, wait)
                signals, exited = self._unstash(*waiter.wait(wait))
                stopping = self._on_signals(ranks, signals, channel)
                if stopping is not None:
                    return stopping
                failed = next((r for r in exited if r.returncode not in (None, 0)), None)
                if channel is not None and failed is not None and \
                        self._outside_the_job(channel, f"rank {failed.spec.rank} failed"):
                    return _Refused(shell_code(failed.returncode))
                failure = self._first_failure(exited, channel)
                if failure is not None:
                    return failure
                if stall_timeout and self._board is not None:
                    stall = self._check_stall(ranks, stall_timeout, channel)
                    if stall is not None:
                        return stall
                answered = self._answered(channel) if channel is not None else None
                if answered is not None:  # first: a restart to let this node in is reported as one elsewhere
                    return answered
                if channel is not None and self._elsewhere(channel):
                    self._report_ended(ranks, channel)
                    if channel.stall_reported():
                        say("stall: another node found the job stalled (--stall_timeout); the stacks of this "
                            "node's ranks follow")
                        self._diagnose_stall(ranks, channel, [])
                    return _Elsewhere()
        return None

    def _on_signals(self, ranks: list[Rank], signals: list[int], channel: JobChannel | None) -> int | None:
        """Act on the signals the launcher received: the first stopping one, once passed on (else None)."""
        for signum in signals:
            if signum in STOPPING:
                self._stop(ranks, signum, channel)
                return signum
            if signum == signal.SIGQUIT:
                say("received SIGQUIT: the stacks of this node's ranks follow; the job goes on")
                self._show_stacks(ranks)
            else:
                pass_on(ranks, signum)
        return None

    def _stop(self, ranks: list[Rank], signum: int, channel: JobChannel | None) -> None:
        """A stopping signal: record it for the other nodes (before any rank of theirs can fail
        because of it), then pass it on to this node's ranks."""
        self._signals_seen.append(signum)
        try:
            # a node the job has not let in yet takes back its request: the job goes on as it was
            if channel is not None and not self._outside_the_job(
                    channel, f"its launcher received {signal.Signals(signum).name}"):
                self._record_signal(channel, signum)
        finally:  # also at a second signal during the record (Stopped)
            forward(ranks, signum)

    def _record_signal(self, channel: JobChannel, signum: int, meanwhile: Meanwhile | None = None) -> bool:
        """Record for the other nodes that this launcher received ``signum``; whether the store took it."""
        self._signal_recorded = True
        try:
            channel.report(Failure(self.plan.node_rank, channel.host, -1, 128 + signum, time.time(),
                                   pid=os.getpid(), cause=SIGNALLED), meanwhile)
            channel.done_reporting(meanwhile)
        except StoreLost:
            return False  # the other nodes will find this one lost instead
        return True

    def _first_failure(self, exited: list[Rank], channel: JobChannel | None) -> _Failure | None:
        """The first of the ranks that just exited to have failed, recorded for the other nodes.

        A rank that failed with another rank's error (every rank raises an error they agreed on)
        is a symptom: while that rank of this node is still on its way out, it is waited for, up
        to ``_ECHO_WAIT_S``, to be named instead; one on another node wins the agreement there.
        Ranks that exited together are taken in the order their scripts ended with an error."""
        if self._board is not None and len(exited) > 1:
            board = self._board
            exited = sorted(exited, key=lambda r: board.ended_order(r.spec.rank))
        for r in exited:
            elastic = self.plan.min_ranks and not self._signals_seen
            if r.returncode != 0 and elastic and self._goes_on_without(r, channel):
                if r.returncode > 0:  # an error of its own, not a kill: why it left
                    show_cause(r.spec)
                self._start_again(r, channel)
                continue
            if r.returncode != 0:
                origin = self._board.echo_of(r.spec.rank) if self._board is not None else None
                if origin is None and self._board is not None:
                    origin = self._board.ended_before(r.spec.rank, [o.spec.rank for o in self._ranks
                                                                    if o.returncode is None])
                local = {o.spec.rank: o for o in self._ranks}.get(origin) if origin is not None else None
                if local is not None and local.returncode is None:
                    self._echoes.append((r, time.monotonic() + _ECHO_WAIT_S))
                    continue
                return self._failed(r, channel, echo=origin is not None and local is None)
            if self.plan.verbose:
                say(f"rank {r.spec.rank} finished")
        now = time.monotonic()
        for r, deadline in self._echoes:
            if now >= deadline:  # the rank it names has not failed yet: name this one after all
                return self._failed(r, channel, echo=False)
        return None

    def _report_ended(self, ranks: list[Rank], channel: JobChannel) -> None:
        """Another node reported a failure: record this node's ranks whose scripts ended with an
        error too, since one may have failed first. Its exit can follow the error by the seconds
        the interpreter takes to shut down, while the peers whose collectives its teardown broke
        are reported at once; so each is waited for, up to ``_ECHO_WAIT_S``, for its exit code."""
        board = self._board
        if board is None:
            return
        # still on their way out, waiting for a rank to be named, or exited during the store call
        ended = [r for r in ranks if r.returncode is None and board.ended_at(r.spec.rank) is not None]
        ended += [r for r, _ in self._echoes] + self._stashed[1]
        deadline = time.monotonic() + _ECHO_WAIT_S
        while any(r.returncode is None for r in ended) and time.monotonic() < deadline:
            self._meanwhile(_ECHO_POLL_S)  # as a wait for the store: a stopping signal ends it
        self._echoes, self._stashed = [], (self._stashed[0], [])
        for r in ended:
            if r.returncode not in (None, 0):
                self._failed(r, channel, echo=board.echo_of(r.spec.rank) is not None)

    def _goes_on_without(self, r: Rank, channel: JobChannel | None) -> bool:
        """An elastic job's rank exited with an error: whether the job goes on without it (the
        master's launcher decides, for every node)."""
        token = self._in_place.tokens.pop(r.spec.rank, None)
        # started again in place: not let in after it died (if it was let in, it is lost again)
        if token is not None and withdraw(self._store_call(channel), self._in_place.attempt, token,
                                          f"rank {r.spec.rank} exited first"):
            say(f"rank {r.spec.rank}, started again in place, exited before the job let it in "
                f"({describe_exit(r.returncode)})")
        if self._members is not None:
            return self._members.lose(r.spec.rank, r.returncode)
        if channel is None:
            return False
        goes_on = ask_master(channel.call, channel.pause, channel.attempt, r.spec.rank, r.returncode)
        if goes_on and self.plan.verbose:
            say(f"rank {r.spec.rank} was lost ({describe_exit(r.returncode)}): the job goes on without it")
        return goes_on

    def _let_in(self, ranks: list[Rank], wait: float | None) -> float | None:
        """On one node, where no beat polls the store: answer the ranks started again in place
        (none joins ranks done training, and one let in just before leaves); how long the monitor
        may wait until it asks again."""
        assert self._members is not None
        if any(r.returncode == 0 for r in ranks) and not self._members.finishing:
            self._members.finish()
        if not self._members.waiting:
            return wait
        self._members.answer()
        return BEAT_S if wait is None else min(wait, BEAT_S)

    def _store_call(self, channel: JobChannel | None) -> Any:
        """``call(name, *args)`` of the store where the membership is."""
        return channel.call if channel is not None else \
            lambda name, *args: getattr(self._launcher_store, name)(*args)

    def _start_again(self, r: Rank, channel: JobChannel | None) -> None:
        """Start a rank the elastic job went on without again in place (``--rank_restarts``), to
        join the running job once ready: what it left (its process group, its progress records)
        is cleared, and the new process takes its place in this attempt's ranks."""
        in_place, rank = self._in_place, r.spec.rank
        nth = None if self._members is not None and self._members.finishing else in_place.take(rank)
        if nth is None:
            if self.plan.rank_restarts:
                say(f"rank {rank} is not started again (--rank_restarts {self.plan.rank_restarts} used, or the "
                    f"job is finishing)")
            return
        r.signal_group(signal.SIGKILL)  # what is left of it: its dataloader workers, say
        if self._board is not None:
            self._board.reset(rank)
        token = ask_to_join(self._store_call(channel), in_place.attempt, self.plan.node_rank, [rank])
        in_place.tokens[rank] = token
        if channel is None and self._members is not None:
            self._members.answer()  # takes the request in: the monitor then answers it as its ranks get ready
        with self._reaper.starting():
            new = spawn(self.plan, r.spec, open_logs(r.spec), in_place.env(r.spec.local_rank, token), (),
                        in_place.watchdog, self._prefork)
            self._ranks[self._ranks.index(r)] = new
        in_place.waiter.add(new)
        if r.pidfd is not None:  # its pumps and logs close as the waiter reads the end of its output
            os.close(r.pidfd)
            r.pidfd = None
        say(f"rank {rank} (local rank {r.spec.local_rank}) started again in place ({nth} of "
            f"--rank_restarts {self.plan.rank_restarts}), pid {new.proc.pid}: it joins the running job once ready")

    def _failed(self, r: Rank, channel: JobChannel | None, *, echo: bool) -> _Failure:
        if channel is not None:
            # when its script ended with the error, where it recorded that: a rank on another node
            # whose collective this one's teardown broke may be reported before this one exits
            ended = self._board.ended_at(r.spec.rank) if self._board is not None else None
            channel.report(Failure(self.plan.node_rank, channel.host, r.spec.rank, r.returncode,
                                   time.time(), failure_tail(r.spec, r.kept()), r.proc.pid,
                                   ECHOED if echo else EXITED, ended or 0.0))
        return _Failure(r, r.returncode)

    def _check_stall(self, ranks: list[Rank], timeout: float, channel: JobChannel | None) -> _Stall | None:
        """A stall, once reported (stacks, diagnosis, and the records for the other nodes)."""
        assert self._board is not None
        live = {r.spec.rank for r in ranks if r.returncode is None}
        stalled = self._board.stalled(live, time.monotonic(), timeout)
        if not stalled:
            return None
        say(f"stall: rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))} made no progress "
            f"for {timeout:g} s (--stall_timeout); the stacks of this node's ranks follow")
        self._diagnose_stall(ranks, channel, stalled)
        if channel is None:  # on several nodes the agreed verdict follows instead
            say(f"stopping the job as a stall (exit code {STALL_EXIT_CODE})")
        return _Stall([r for r in ranks if r.spec.rank in stalled])

    def _elsewhere(self, channel: JobChannel) -> bool:
        """Whether another node failed or stopped answering (a lost node is reported here). In an
        elastic job the master's launcher answers the other nodes' lost ranks and goes on without
        a lost node while enough ranks live; the other launchers leave lost nodes to it."""
        if self._members is not None:
            for node in self._members.answer():  # a launcher started again for it: it beats anew
                self._let_go.discard(node)
                channel.welcome(node)
            while self._members.restart_for:  # a torchrun script's job: every node starts again with it
                self._joiners.add(self._members.restart_for[-1])
                channel.report(Failure(self._members.restart_for.pop(), "?", -1, 0, time.time(), cause=GROWING))
        if channel.any_failed():
            return True
        now = time.monotonic()
        if now < self._next_liveness_check or (self.plan.min_ranks and self._members is None):
            return False  # two store calls per node: not on every poll
        self._next_liveness_check = now + _LIVENESS_EVERY_S
        lost = [f for f in channel.lost_nodes() if f.node not in self._let_go]
        if self._members is not None:
            for failure in list(lost):
                if self._members.lose_node(failure.node, time.time() - failure.when):
                    self._let_go.add(failure.node)
                    lost.remove(failure)
        for failure in lost:
            channel.report(failure)
        return bool(lost)

    def _finish_job(self, ranks: list[Rank], wake_r: int, channel: JobChannel) -> _Elsewhere | int | None:
        """This node's ranks all finished: say so, and on the master keep the store up until every
        node is done (None), another failed (_Elsewhere) or a stopping signal came (int)."""
        channel.finish()
        if not self.plan.hosts_store:
            return None
        # no node joins ranks done training (not ranks all lost: the others may still train)
        if self._members is not None and any(r.returncode == 0 for r in ranks):
            self._members.finish()
        # a launcher that asks to join (its ranks wait to be let in, as a script that does not
        # follow the membership leaves them) is answered no, and the store stays up until it read that
        left_by: float | None = None
        with Waiter([], wake_r, HANDLED) as waiter:
            while True:
                if channel.all_done(self._let_go):
                    left_by = left_by or time.monotonic() + self.plan.grace_period + _DEPARTURE_S
                    if self._members is None or not channel.rejoining(self._let_go) or time.monotonic() > left_by:
                        break
                signals, _ = waiter.wait(BEAT_S)
                stopping = [s for s in signals if s in STOPPING]
                if stopping:
                    self._signals_seen.extend(stopping)
                    self._record_signal(channel, stopping[0])
                    return stopping[0]
                if self._elsewhere(channel):
                    return _Elsewhere()
        return None

    def _show_stacks(self, ranks: list[Rank]) -> list[Stacks]:
        dumps = collect(self._control_dir, [(r.spec.rank, r.proc.pid) for r in ranks if r.returncode is None])
        sys.stderr.write(format_stacks(dumps))
        sys.stderr.flush()
        return dumps

    def _diagnose_stall(self, ranks: list[Rank], channel: JobChannel | None, suspects: list[int]) -> None:
        """Print this node's stacks and diagnosis, and record what it found for the other nodes."""
        progress = self._board.read() if self._board else {}
        dumps = self._show_stacks(ranks)
        diagnosis = diagnose(dumps, progress, time.monotonic())
        for line in diagnosis.lines:
            say(line)
        if channel is not None:
            for failure in stall_failures(diagnosis, dumps, progress, self.plan.node_rank, channel.host, suspects):
                channel.report(failure)

    def _teardown(self, ranks: list[Rank], wake_r: int, watchdog: Watchdog, first: int | None) -> None:
        """Signal the live ranks (unless already done), give them the grace period, then SIGKILL.
        The prefork server lives on: it runs nothing of the job's, and a restart's ranks fork from it
        without importing torch again (~3 s of CPU a node)."""
        server = (self._prefork.pid,) if self._prefork is not None and self._prefork.alive else ()
        self._signals_seen.extend(teardown(ranks, wake_r, watchdog, self.plan.grace_period, first, server))
