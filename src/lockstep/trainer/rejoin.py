"""After an elastic job's ranks changed: every rank at the step the furthest one reached.

A rank whose gradient all-reduce completed just as a peer was lost took the optimizer step; the
others, whose all-reduce failed, did not; and a rank may have taken the step but failed in a
collective of the batch's end (a metric's gather) before its timestamp moved. The lowest rank of
those that got furthest sends its weights, optimizer, schedules and timestamp, and the batch it
has yet to end, to the others.
"""

from __future__ import annotations

import torch

from lockstep import _agreement, dist
from lockstep.state import State
from lockstep.time import Timestamp


def agree_room() -> None:
    """Widen every rank's room for small objects (:mod:`lockstep._agreement`) to the widest, so
    that their gathers match on the new process group: a collective of it. ``catch_up`` does this
    too; a backend that reloads a checkpoint after the change instead (FSDP) calls this first."""
    rooms = dist.all_gather(torch.tensor([_agreement.small_object_room()], dtype=torch.int64))
    _agreement.widen_small_object_room(max(int(t[0]) for t in rooms))


def end_pending(pending: bool, batch: int) -> bool:
    """Whether the ranks go on with the end of ``batch`` that the change interrupted after its
    BATCH_END (a collective of the new process group): all of them, or none, have it to do. A
    RuntimeError where only some have: the others passed the batch's last collective, and what
    they would do next no longer matches."""
    flags = dist.all_reduce(torch.tensor([int(pending), -int(pending)], dtype=torch.int64), "MAX").tolist()
    some, every = flags[0] == 1, flags[1] == -1  # the most, and minus the least
    if some and not every:
        raise RuntimeError(f"the ranks left disagree on whether batch {batch}'s end (its evaluations, checkpoint "
                           f"and epoch end) is done, after a change of the job's ranks: the job cannot go on "
                           f"exactly; run it again with autoresume")
    return every


def catch_up(state: State, unended: tuple | None, *, fresh: bool = False) -> tuple[int, tuple | None]:
    """Bring every rank to the furthest rank's step (a collective of the new process group): how
    many ranks were behind, and the batch whose optimizer step was taken but whose end (the
    timestamp's move, BATCH_END) was not, if the furthest rank has one (``unended`` is this
    rank's: ``(samples, tokens, is_last)``). A ``fresh`` rank (one that joined the running job)
    is behind every other, whatever its timestamp: its weights are its own script's."""
    progress = -1 if fresh else 2 * state.timestamp.batch.value + (unended is not None)
    gathered = dist.all_gather(torch.tensor([progress, _agreement.small_object_room()], dtype=torch.int64))
    reached = [int(t[0]) for t in gathered]
    _agreement.widen_small_object_room(max(int(t[1]) for t in gathered))  # the same on every rank
    furthest = max(reached)
    behind = sum(r < furthest for r in reached)
    if not behind:
        return 0, unended
    source = reached.index(furthest)
    payload: list = [None]
    if dist.get_global_rank() == source:
        payload = [{"model": state.model.state_dict(), "optimizers": [o.state_dict() for o in state.optimizers],
                    "schedulers": [s.state_dict() for s in state.schedulers],
                    "timestamp": state.timestamp.state_dict(),
                    "unended": None if unended is None else (unended[0], int(unended[1]), unended[2])}]
    dist.broadcast_object_list(payload, src=source)
    if dist.get_global_rank() != source:
        sent = payload[0]
        state.model.load_state_dict(sent["model"])
        for optimizer, saved in zip(state.optimizers, sent["optimizers"]):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(state.schedulers, sent["schedulers"]):
            scheduler.load_state_dict(saved)
        state.timestamp = Timestamp.from_state_dict(sent["timestamp"])
        unended = sent["unended"]
    return behind, unended
