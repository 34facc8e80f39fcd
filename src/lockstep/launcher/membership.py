"""The launcher's side of an elastic job on one node (``--min_ranks``): which ranks train, and a
new generation of them, published in the store it hosts, each time one is lost while enough live.

The ranks watch ``<prefix>generation`` and read ``<prefix>members<g>``, the ranks (numbered as at
launch) of generation g in their new order (lockstep.elastic.membership); each counts itself in
``<prefix>joined`` once it follows them. A job whose ranks do not all follow (a script without
lockstep's Trainer) stops at a lost rank, as without ``--min_ranks``: the others would wait in a
collective for the process group's timeout.
"""

from __future__ import annotations

import json
import time
from typing import Any

from lockstep.launcher.elastic_names import elastic_prefix, generation_key, joined_key, members_key
from lockstep.launcher.report import describe_exit, say


class Members:
    """This attempt's membership: the launch ranks that train now, and how many must."""

    def __init__(self, store: Any, attempt: int, ranks: list[int], minimum: int) -> None:
        self._store, self._prefix = store, elastic_prefix(attempt)
        self.ranks, self.minimum, self.generation = list(ranks), minimum, 0
        self._full = len(ranks)

    def lose(self, rank: int, code: int) -> bool:
        """Publish the generation without ``rank`` (which exited with ``code``) when at least the
        minimum remain; whether the job goes on."""
        if rank not in self.ranks:
            return True  # a rank of an earlier generation that the launcher already let go
        remaining = [r for r in self.ranks if r != rank]
        if int(self._store.add(joined_key(self._prefix), 0)) < self._full:
            say(f"rank {rank} was lost ({describe_exit(code)}) and not every rank follows a change of the job's "
                f"ranks (lockstep's Trainer does, under --min_ranks): the job stops")
            return False
        if len(remaining) < self.minimum:
            say(f"rank {rank} was lost ({describe_exit(code)}): {len(remaining)} rank{'s' * (len(remaining) != 1)} "
                f"would remain, fewer than --min_ranks {self.minimum}; the job stops")
            return False
        started = time.monotonic()
        self.generation += 1
        self._store.set(members_key(self._prefix, self.generation), json.dumps(remaining))
        self._store.add(generation_key(self._prefix), 1)
        self.ranks = remaining
        say(f"rank {rank} left ({describe_exit(code)}): {len(remaining)} of {self._full} ranks go on at world "
            f"size {len(remaining)} (generation {self.generation}, published in "
            f"{time.monotonic() - started:.2f} s)")
        return True
