"""What a change of an elastic job's ranks was, as each rank tells it once the job goes on: a line
on the console, metrics for the loggers, a record in the run folder's ``metrics.jsonl`` and the
argument of :meth:`lockstep.Callback.ranks_changed`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RanksChanged:
    """One change of the ranks that train.

    Ranks are named by the rank each had at launch. ``batch`` is the batch the job goes on at:
    the step that was in flight is trained again on the ranks left, and no finished step is (the
    ranks first take the furthest rank's weights); ``ranks_behind`` is how many ranks had not
    taken that furthest step. Under FSDP and DeepSpeed the lost ranks' shards exist nowhere else:
    the job goes on from its last checkpoint, resharded, and ``trained_again`` finished steps are
    trained again; when ranks only joined, the ranks that trained give them the state from their
    shards, and none is.
    ``seconds`` runs from this rank's noticing the change to the new process group's first step
    being ready.
    """

    generation: int
    world_size: int
    previous_world_size: int
    left: tuple[int, ...]
    joined: tuple[int, ...]
    batch: int
    seconds: float
    ranks_behind: int
    trained_again: int = 0

    def describe(self) -> str:
        """The console line."""
        who = []
        if self.left:
            who.append(f"rank{'s' * (len(self.left) > 1)} {_names(self.left)} (at launch) left")
        if self.joined:
            who.append(f"rank{'s' * (len(self.joined) > 1)} {_names(self.joined)} joined")
        behind = f"; {self.ranks_behind} rank(s) took the furthest rank's step" if self.ranks_behind else ""
        again = (f"{self.trained_again} finished step(s) are trained again (from the last checkpoint, resharded)"
                 if self.trained_again else "no finished step is trained again")
        return (f"lockstep: {' and '.join(who) or 'the ranks changed'}: the job goes on at world size "
                f"{self.world_size} (was {self.previous_world_size}; generation {self.generation}) from batch "
                f"{self.batch}, {self.seconds:.2f} s after the change; {again}{behind}")

    def metrics(self) -> dict[str, float]:
        """For ``logger.log_metrics``: numbers a dashboard can plot against the step."""
        return {"elastic/world_size": self.world_size, "elastic/generation": self.generation,
                "elastic/ranks_left": len(self.left), "elastic/ranks_joined": len(self.joined),
                "elastic/seconds": self.seconds, "elastic/trained_again": self.trained_again}

    def record(self) -> dict[str, Any]:
        """The run folder's ``metrics.jsonl`` record (``kind`` ``"ranks"``)."""
        return {"kind": "ranks", **asdict(self), "left": list(self.left), "joined": list(self.joined)}


def _names(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)
