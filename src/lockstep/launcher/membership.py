"""The launchers' side of an elastic job (``--min_ranks``, ``--nnodes MIN:MAX``): which ranks train,
and a new generation of them, published in the store the master's launcher hosts, each time ranks
are lost while enough live.

The ranks watch ``<prefix>generation`` and read ``<prefix>members<g>``, the ranks (numbered as at
launch) of generation g in their new order (lockstep.elastic.membership); each counts itself in
``<prefix>joined`` once it follows them. A job whose ranks do not all follow (a script without
lockstep's Trainer) stops at a lost rank, as without ``--min_ranks``: the others would wait in a
collective for the process group's timeout.

Only the master's launcher (the one that hosts the store) publishes. Another node's launcher that
loses a rank appends ``[rank, exit code]`` to ``<prefix>lost`` and waits for the master's answer
(:func:`ask_master`); a node whose launcher stops beating is lost with all its ranks
(:meth:`Members.lose_node`). A node cut off from the master loses the store and stops, so the
master's side is the one that goes on: a partition never leaves two groups training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from lockstep.launcher.elastic_names import (
    answer_key,
    elastic_prefix,
    generation_key,
    joined_key,
    lost_key,
    members_key,
)
from lockstep.launcher.report import describe_exit, say

_ANSWER_WAIT_S = 30.0
"""How long another node's launcher waits for the master's answer before it stops the job."""


class Members:
    """This attempt's membership, kept by the master's launcher: the launch ranks that train now,
    and how many must."""

    def __init__(self, store: Any, attempt: int, ranks: list[int], minimum: int, per_node: int) -> None:
        self._store, self._prefix = store, elastic_prefix(attempt)
        self.ranks, self.minimum, self.generation, self.per_node = list(ranks), minimum, 0, per_node
        self._full = len(ranks)
        self._answered = 0  # the lines of <prefix>lost already answered

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
        return self._publish(gone, f"node {node} (ranks {', '.join(map(str, gone))})",
                             f"its launcher silent for {silent_s:.1f} s")

    def answer(self) -> None:
        """Decide on the ranks other nodes lost since the last call, and answer each node."""
        if not self._store.check([lost_key(self._prefix)]):
            return
        lines = self._store.get(lost_key(self._prefix)).decode().splitlines()
        for line in lines[self._answered:]:
            rank, code = json.loads(line)
            self._store.set(answer_key(self._prefix, rank), "go" if self.lose(rank, code) else "stop")
        self._answered = len(lines)

    def _publish(self, gone: list[int], who: str, why: str) -> bool:
        remaining = [r for r in self.ranks if r not in gone]
        if int(self._store.add(joined_key(self._prefix), 0)) < self._full:
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


def ask_master(call: Callable[..., Any], pause: Callable[[float], None], attempt: int, rank: int,
               code: int) -> bool:
    """On a node other than the master's: tell the master's launcher that ``rank`` exited with
    ``code``, and whether the job goes on without it (its answer; no answer in time: it stops)."""
    prefix = elastic_prefix(attempt)
    call("append", lost_key(prefix), json.dumps([rank, code]) + "\n")
    deadline = time.monotonic() + _ANSWER_WAIT_S
    while time.monotonic() < deadline:
        if call("check", [answer_key(prefix, rank)]):
            return call("get", answer_key(prefix, rank)).decode() == "go"
        pause(0.05)
    say(f"rank {rank} was lost ({describe_exit(code)}) and the master's launcher did not answer within "
        f"{_ANSWER_WAIT_S:g} s: the job stops")
    return False
