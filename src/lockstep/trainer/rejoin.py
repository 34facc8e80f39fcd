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


def end_pending(taken: int, ends_epoch: bool, batch: int) -> bool:
    """Whether the ranks take up the end of ``batch`` that the change interrupted after its
    BATCH_END (a collective of the new process group): ``taken`` is how many of its steps this
    rank took (:class:`~lockstep.trainer.batch_end.BatchEnd`; -1: none to take up). Where the
    ranks differ (a rank that took the batch's optimizer step alone, whose peers catch up
    without its end), none takes it up, as before; unless it ends an epoch, which must then be
    counted on every rank: a RuntimeError instead of training that epoch twice."""
    flags = torch.tensor([taken, -taken, int(ends_epoch)], dtype=torch.int64)
    most, minus_least, epoch = (int(v) for v in dist.all_reduce(flags, "MAX").tolist())
    if most == -minus_least:
        return most >= 0
    if epoch:
        raise RuntimeError(f"the ranks left are at different steps of the end of batch {batch}, the last of its "
                           f"epoch, after a change of the job's ranks: the job cannot go on exactly; run it "
                           f"again with autoresume")
    return False


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
