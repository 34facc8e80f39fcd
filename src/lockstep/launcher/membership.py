"""The launchers' side of an elastic job (``--min_ranks``, ``--nnodes MIN:MAX``): which ranks train,
and a new generation of them, published in the store the master's launcher hosts, each time ranks
are lost while enough live.

The ranks watch ``<prefix>generation`` and read ``<prefix>members<g>``, the ranks (numbered as at
launch) of generation g in their new order (lockstep.elastic.membership); each counts itself in
``<prefix>joined`` once it follows them. A job whose ranks do not all follow (a script without
lockstep's Trainer) stops at a lost rank, as without ``--min_ranks``: the others would wait in a
collective for the process group's timeout. It lets a node in as torchrun does: every node starts
its ranks again with the new node's (the node's ranks say they form their group themselves).

Only the master's launcher (the one that hosts the store) publishes. Another node's launcher that
loses a rank appends ``[rank, exit code]`` to ``<prefix>lost`` and waits for the master's answer
(:func:`ask_master`); a node whose launcher stops beating is lost with all its ranks
(:meth:`Members.lose_node`). A node cut off from the master loses the store and stops, so the
master's side is the one that goes on: a partition never leaves two groups training.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from lockstep.launcher.elastic_names import (
    RESTART,
    admit_key,
    answer_key,
    elastic_prefix,
    finished_key,
    generation_key,
    gone_key,
    join_key,
    joined_key,
    lost_key,
    members_key,
    plain_key,
    ready_key,
)
from lockstep.launcher.report import describe_exit, say

_ANSWER_WAIT_S = 30.0
"""How long another node's launcher waits for the master's answer before it stops the job."""


class _Request(NamedTuple):
    """A request to join: a node's launcher started again (every rank of the node), or ranks its
    launcher started again in place (``--rank_restarts``)."""

    node: int
    token: str
    ranks: tuple[int, ...]
    whole_node: bool


class Members:
    """This attempt's membership, kept by the master's launcher: the launch ranks that train now,
    and how many must."""

    def __init__(self, store: Any, attempt: int, ranks: list[int], minimum: int, per_node: int) -> None:
        self._store, self._prefix = store, elastic_prefix(attempt)
        self.ranks, self.minimum, self.generation, self.per_node = list(ranks), minimum, 0, per_node
        self._full = len(ranks)
        self._followers = len(ranks)
        """How many ranks count themselves in ``joined`` before the job may change: those it started with."""
        self._answered = 0  # the lines of <prefix>lost already answered
        self._asked = 0  # the lines of <prefix>join already answered
        self._joining: list[_Request] = []
        """The requests to join (node, token, ranks), each let in once its ranks are ready: a node's
        every rank (its launcher started again), or ranks its launcher started again in place."""
        self.finishing = False
        """Whether this node's ranks finished: no node joins any more."""
        self.restart_for: list[int] = []
        """Nodes that asked to join a job whose ranks follow no change of the membership (a torchrun
        script): each was answered :data:`RESTART`, and every node starts its ranks again with it."""

    def start_without(self, nodes: list[int], waited_s: float) -> None:
        """The job starts without ``nodes`` (they did not join within ``waited_s`` seconds of
        enough nodes joining): the first generation is the other nodes' ranks, which form its
        group at once, and a launcher of a missing node joins the running job when it starts."""
        gone = [r for r in self.ranks if r // self.per_node in nodes]
        for node in nodes:
            self._store.set(gone_key(self._prefix, node), "1")
        self.generation += 1
        self.ranks = [r for r in self.ranks if r not in gone]
        self._followers = len(self.ranks)
        self._store.set(members_key(self._prefix, self.generation), json.dumps(self.ranks))
        self._store.add(generation_key(self._prefix), 1)
        say(f"node(s) {', '.join(map(str, nodes))} (ranks {', '.join(map(str, gone))}) did not join within "
            f"{waited_s:g} s of enough nodes (--rdzv_last_call): {len(self.ranks)} of {self._full} ranks start at "
            f"world size {len(self.ranks)} (generation {self.generation}); a node that starts later joins the "
            f"running job")

    def lose(self, rank: int, code: int) -> bool:
        """Publish the generation without ``rank`` (which exited with ``code``) when at least the
        minimum remain; whether the job goes on."""
        if rank not in self.ranks:
            return True  # a rank of an earlier generation that the launcher already let go
        return self._publish([rank], f"rank {rank}", describe_exit(code))

    def lose_node(self, node: int, silent_s: float) -> bool:
        """Publish the generation without node ``node``'s ranks (its launcher stopped answering
        ``silent_s`` seconds ago) when at least the minimum remain; whether the job goes on."""
        gone = [r for r in self.ranks if r // self.per_node == node]
        if not gone:
            return True
        goes_on = self._publish(gone, f"node {node} (ranks {', '.join(map(str, gone))})",
                                f"its launcher silent for {silent_s:.1f} s")
        if goes_on:  # a launcher started again for it joins the running job
            self._store.set(gone_key(self._prefix, node), "1")
        return goes_on

    def finish(self) -> None:
        """This node's ranks finished training: no node joins any more, and ranks let in just
        before leave (:mod:`lockstep.regroup`)."""
        self.finishing = True
        self._store.set(finished_key(self._prefix), "1")

    def answer(self) -> list[int]:
        """Decide on the ranks other nodes lost since the last call, and answer each node; let in
        the nodes whose launchers asked to join the running job once their ranks are ready (the
        nodes let in)."""
        if self._store.check([lost_key(self._prefix)]):
            lines = self._store.get(lost_key(self._prefix)).decode().splitlines()
            for line in lines[self._answered:]:
                rank, code, asked = json.loads(line)  # asked: the loss's own key (a rank may be lost again)
                self._store.set(answer_key(self._prefix, asked), "go" if self.lose(rank, code) else "stop")
            self._answered = len(lines)
        if self._store.check([join_key(self._prefix)]):
            lines = self._store.get(join_key(self._prefix)).decode().splitlines()
            for node, token, *ranks in map(json.loads, lines[self._asked:]):
                request = _Request(node, token, tuple(ranks[0]) if ranks else self._ranks_of(node), not ranks)
                self._replace_request(request)
                if self._may_join(request):
                    self._joining.append(request)
            self._asked = len(lines)
        admitted = []
        for request in list(self._joining):
            node, token, ranks, whole_node = request
            if self._answered_already(token):  # its launcher withdrew the request
                self._joining.remove(request)
            elif self.finishing:
                self._joining.remove(request)
                self._answer_join(token, "no: the job is finishing" + (
                    "" if self._all_follow() else "; its ranks never followed a change of the job's ranks, which "
                                                  "letting a node in takes (lockstep's Trainer does)"))
            elif self._store.check([plain_key(self._prefix, token)]) and not self._all_follow():
                self._joining.remove(request)
                if self._answer_join(token, RESTART):  # unless its launcher withdrew the request first
                    self.restart_for.append(node)
            elif int(self._store.add(ready_key(self._prefix, token), 0)) >= len(ranks) and self._all_follow() \
                    and (whole_node or self._all_settled()):
                self._joining.remove(request)
                if self._admit(request):
                    admitted.append(node)
        return admitted

    @property
    def waiting(self) -> bool:
        """Whether a request to join waits for an answer."""
        return bool(self._joining)

    def _ranks_of(self, node: int) -> tuple[int, ...]:
        return tuple(node * self.per_node + local for local in range(self.per_node))

    def _all_settled(self) -> bool:
        """Whether every rank of the newest generation has made its change (formed its group, taken
        up the state: lockstep's Trainer counts itself in ``g<generation>/settled``). Ranks let in
        before would land in the middle of it, and the others could skip that generation and the
        change they must make (a lost rank's shards are not where the ranks that trained think
        they are). Asked before a rank started again in place joins, which can be ready in a
        fraction of a second; a node's launcher started again takes seconds to start its ranks."""
        return self.generation == 0 or int(self._store.add(
            f"{self._prefix}g{self.generation}/settled", 0)) >= len(self.ranks)

    def _all_follow(self) -> bool:
        """Whether every rank the job started with follows its membership (they see a change, and
        share their state with a node let in, only from then on)."""
        return int(self._store.add(joined_key(self._prefix), 0)) >= self._followers

    def _may_join(self, request: _Request) -> bool:
        """Whether the ranks of ``request`` may join: a node's launcher, started again, once the job
        let the node go; ranks started again in place, once the job let them go (else its answer
        says why not)."""
        node, token, ranks, whole_node = request
        refusal = "the job is finishing" if self.finishing else None
        if whole_node and (any(r // self.per_node == node for r in self.ranks)
                           or not self._store.check([gone_key(self._prefix, node)])):
            refusal = f"node {node}'s ranks were not let go by the job"
        elif not whole_node and (set(ranks) & set(self.ranks) or self._store.check([gone_key(self._prefix, node)])):
            refusal = f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} {'is' if len(ranks) == 1 else 'are'} " \
                      f"not let go by the job, or {'its' if len(ranks) == 1 else 'their'} node is"
        if refusal is not None:
            self._answer_join(token, f"no: {refusal}")
        return refusal is None

    def _replace_request(self, request: _Request) -> None:
        """A newer launcher of node ``node`` asks to join (or its launcher starts the same ranks
        again): an earlier request that waits (its launcher may have been killed before its ranks
        were ready, or the rank died again) is answered no."""
        node, _, ranks, whole_node = request
        for earlier in [e for e in self._joining if (e.node == node if whole_node else e.ranks == ranks)]:
            self._joining.remove(earlier)
            self._answer_join(earlier[1], f"no: another launcher of node {node} asked to join after it"
                              if whole_node else f"no: rank {', '.join(map(str, ranks))} was started again after it")

    def _answered_already(self, token: str) -> bool:
        return bool(self._store.check([admit_key(self._prefix, token)]))

    def _answer_join(self, token: str, answer: str) -> bool:
        """Answer a request to join, unless its launcher withdrew it first; whether this answer stands."""
        return self._store.compare_set(admit_key(self._prefix, token), "", answer).decode() == answer

    def _admit(self, request: _Request) -> bool:
        """Publish the generation with the request's ranks back (node ``node``'s launcher was
        started again, or it started them again in place, and they are ready), after the ranks
        that train, which keep their order; whether it did (not when the launcher withdrew its
        request meanwhile)."""
        node, token, ranks, whole_node = request
        if not self._answer_join(token, str(self.generation + 1)):
            return False
        back = list(ranks)
        started = time.monotonic()
        self.generation += 1
        # a node's ranks after the ranks that train; ranks started again in place back in their places
        now = self.ranks + back if whole_node else sorted(self.ranks + back)
        if whole_node:
            self._store.delete_key(gone_key(self._prefix, node))
        self._store.set(members_key(self._prefix, self.generation), json.dumps(now))
        self._store.add(generation_key(self._prefix), 1)
        self.ranks = now
        who = f"node {node} (ranks {', '.join(map(str, back))})" if whole_node else \
            f"rank{'s' * (len(back) > 1)} {', '.join(map(str, back))}"
        say(f"{who} joined: {len(now)} of {self._full} ranks go on at world size {len(now)} (generation "
            f"{self.generation}, published in {time.monotonic() - started:.2f} s)")
        return True

    def _publish(self, gone: list[int], who: str, why: str) -> bool:
        remaining = [r for r in self.ranks if r not in gone]
        if not self._all_follow():
            say(f"{who} was lost ({why}) and not every rank follows a change of the job's ranks (lockstep's "
                f"Trainer does, under --min_ranks): the job stops")
            return False
        if len(remaining) < self.minimum:
            say(f"{who} was lost ({why}): {len(remaining)} rank{'s' * (len(remaining) != 1)} would remain, fewer "
                f"than --min_ranks {self.minimum}; the job stops")
            return False
        started = time.monotonic()
        self.generation += 1
        self._store.set(members_key(self._prefix, self.generation), json.dumps(remaining))
        self._store.add(generation_key(self._prefix), 1)
        self.ranks = remaining
        say(f"{who} left ({why}): {len(remaining)} of {self._full} ranks go on "
            f"at world size {len(remaining)} (generation {self.generation}, published in "
            f"{time.monotonic() - started:.2f} s)")
        return True


def ask_to_join(call: Callable[..., Any], attempt: int, node: int, ranks: list[int] | None = None) -> str:
    """On a node the running job went on without, whose launcher was started again: ask the
    master's launcher to let its ranks back in (once they are ready: see :func:`admission`); with
    ``ranks``, the ranks of this node the job went on without, which its launcher started again
    in place (``--rank_restarts``). The request's token, which its ranks carry in
    ``LOCKSTEP_ELASTIC_JOIN``."""
    token = uuid.uuid4().hex
    call("append", join_key(elastic_prefix(attempt)), json.dumps([node, token, *([ranks] if ranks else [])]) + "\n")
    return token


def admission(call: Callable[..., Any], attempt: int, token: str) -> int | str | None:
    """The answer to :func:`ask_to_join`'s request ``token``: the generation the node's ranks
    joined in, :data:`RESTART` (every node starts its ranks again, this one's with them), why
    not, or None while the master waits for them to be ready."""
    key = admit_key(elastic_prefix(attempt), token)
    if not call("check", [key]):
        return None
    answer = call("get", key).decode()
    return int(answer) if answer.isdigit() else answer if answer == RESTART else answer.removeprefix("no: ")


def withdraw(call: Callable[..., Any], attempt: int, token: str, why: str) -> bool:
    """Take back the request to join ``token`` (its launcher is stopping, or a rank of it failed
    before the master let them in); False where the master answered first (the answer stands)."""
    key, answer = admit_key(elastic_prefix(attempt), token), f"no: withdrawn ({why})"
    return call("compare_set", key, "", answer).decode() == answer


def was_let_go(call: Callable[..., Any], attempt: int, node: int) -> bool:
    """Whether the running elastic ``attempt`` went on without node ``node`` (so that a launcher
    started again for it may join)."""
    return bool(call("check", [gone_key(elastic_prefix(attempt), node)]))


def ask_master(call: Callable[..., Any], pause: Callable[[float], None], attempt: int, rank: int,
               code: int) -> bool:
    """On a node other than the master's: tell the master's launcher that ``rank`` exited with
    ``code``, and whether the job goes on without it (its answer; no answer in time: it stops)."""
    prefix, asked = elastic_prefix(attempt), f"{rank}-{uuid.uuid4().hex}"  # the rank, started again, may be lost again
    call("append", lost_key(prefix), json.dumps([rank, code, asked]) + "\n")
    deadline = time.monotonic() + _ANSWER_WAIT_S
    while time.monotonic() < deadline:
        if call("check", [answer_key(prefix, asked)]):
            return call("get", answer_key(prefix, asked)).decode() == "go"
        pause(0.05)
    say(f"rank {rank} was lost ({describe_exit(code)}) and the master's launcher did not answer within "
        f"{_ANSWER_WAIT_S:g} s: the job stops")
    return False
