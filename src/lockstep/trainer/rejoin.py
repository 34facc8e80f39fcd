"""After an elastic job's ranks changed: every rank at the step the furthest one reached.

A rank whose gradient all-reduce completed just as a peer was lost took the optimizer step; the
others, whose all-reduce failed, did not; and a rank may have taken the step but failed in a
collective of the batch's end (a metric's gather) before its timestamp moved. The lowest rank of
those that got furthest sends its weights, optimizer, schedules and timestamp, and the batch it
has yet to end, to the others. Under a backend that shards its state (FSDP), the ranks that trained
hold every shard only when none was lost and all got equally far (:func:`peers_hold_the_state`);
otherwise the job goes back to its last checkpoint.
"""

from __future__ import annotations

import torch

from lockstep import _agreement, dist
from lockstep.state import State
from lockstep.trainer.batch_end import BatchEnd
from lockstep.time import Timestamp


def _progress(state: State, unended: tuple | None, fresh: bool) -> int:
    """How far this rank got: twice its batch, plus one for a batch whose optimizer step it took
    but whose end it did not; -1 for a rank that joined (its weights are its own script's)."""
    return -1 if fresh else 2 * state.timestamp.batch.value + (unended is not None)


def peers_hold_the_state(state: State, unended: tuple | None, can: bool, *, fresh: bool = False) -> bool:
    """Whether the ranks of a backend that shards its state take it from the ranks that trained
    rather than from the last checkpoint (a collective of the new process group): only if every
    rank ``can`` (no rank that held a shard was lost) and every rank that trained got equally far,
    so that its shards belong to one step. Widens every rank's room for small objects
    (:mod:`lockstep._agreement`) to the widest too, so that their gathers match on the new group."""
    gathered = dist.all_gather(torch.tensor([_progress(state, unended, fresh), int(can),
                                             _agreement.small_object_room()], dtype=torch.int64))
    _agreement.widen_small_object_room(max(int(t[2]) for t in gathered))
    reached = {int(t[0]) for t in gathered if int(t[0]) >= 0}
    return all(int(t[1]) for t in gathered) and len(reached) == 1


def end_pending(tail: BatchEnd | None, joined: bool, batch: int) -> tuple[int, tuple | None]:
    """How many steps of the end of ``batch`` that the change interrupted after its BATCH_END
    the ranks took, where they take it up (a collective of the new process group); -1 where none
    is taken up. ``tail`` is this rank's end of its last batch (None: none in flight). Where the
    ranks that trained differ (a rank that took the batch's optimizer step alone, whose peers
    catch up without its end), none takes it up, as before; unless it ends an epoch, which must
    then be counted on every rank: a RuntimeError instead of training that epoch twice. A rank
    that ``joined`` the running job has none of its own: it follows the others, and gets what
    theirs was made from (:meth:`BatchEnd.described`) to make its own."""
    own = None if joined else (-1, None) if tail is None else (tail.taken, tail.described())
    told = [t for t in dist.all_gather_object(own) if t is not None]
    if len({taken for taken, _ in told}) == 1:
        return told[0]
    if any(made_from is not None and made_from[2] for _, made_from in told):  # it ends an epoch
        raise RuntimeError(f"the ranks left are at different steps of the end of batch {batch}, the last of its "
                           f"epoch, after a change of the job's ranks: the job cannot go on exactly; run it "
                           f"again with autoresume")
    return -1, None


def catch_up(state: State, unended: tuple | None, *, fresh: bool = False,
             weights: bool = True) -> tuple[int, tuple | None]:
    """Bring every rank to the furthest rank's step (a collective of the new process group): how
    many ranks were behind, and the batch whose optimizer step was taken but whose end (the
    timestamp's move, BATCH_END) was not, if the furthest rank has one (``unended`` is this
    rank's: ``(samples, tokens, is_last)``). A ``fresh`` rank (one that joined the running job)
    is behind every other, whatever its timestamp: its weights are its own script's. Without
    ``weights`` the model and optimizers stay as they are (a backend that shards its state moves
    them itself)."""
    gathered = dist.all_gather(torch.tensor([_progress(state, unended, fresh), _agreement.small_object_room()],
                                            dtype=torch.int64))
    reached = [int(t[0]) for t in gathered]
    _agreement.widen_small_object_room(max(int(t[1]) for t in gathered))  # the same on every rank
    furthest = max(reached)
    behind = sum(r < furthest for r in reached)
    if not behind:
        return 0, unended
    source = reached.index(furthest)
    payload: list = [None]
    if dist.get_global_rank() == source:
        payload = [{"model": state.model.state_dict() if weights else None,
                    "optimizers": [o.state_dict() for o in state.optimizers] if weights else [],
                    "schedulers": [s.state_dict() for s in state.schedulers],
                    "timestamp": state.timestamp.state_dict(),
                    "unended": None if unended is None else (unended[0], int(unended[1]), unended[2])}]
    dist.broadcast_object_list(payload, src=source)
    if dist.get_global_rank() != source:
        sent = payload[0]
        if sent["model"] is not None:
            state.model.load_state_dict(sent["model"])
        for optimizer, saved in zip(state.optimizers, sent["optimizers"]):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(state.schedulers, sent["schedulers"]):
            scheduler.load_state_dict(saved)
        state.timestamp = Timestamp.from_state_dict(sent["timestamp"])
        unended = sent["unended"]
    return behind, unended
