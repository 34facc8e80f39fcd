"""The decision after a change of an elastic job's ranks under a backend that shards its state:
from the ranks that trained, or from the last checkpoint (``lockstep.trainer.rejoin``), on real ranks."""

from __future__ import annotations

from types import SimpleNamespace

from lockstep.testing import run_distributed

# Per case, each of 3 ranks: (batch it reached or None for a rank that joined, took the step of
# the next batch without ending it, whether it can take the state from its peers)
CASES = {
    "joined, the others equally far": [(None, False, True), (5, False, True), (5, False, True)],
    "joined, both took the step in flight": [(None, False, True), (5, True, True), (5, True, True)],
    "one took the step in flight, one not": [(None, False, True), (5, True, True), (5, False, True)],
    "a rank that held a shard was lost": [(None, False, True), (5, False, False), (5, False, False)],
    "one a batch behind": [(5, False, True), (4, False, True), (5, False, True)],
}


def _decide(_: int) -> dict[str, bool]:
    from lockstep import dist
    from lockstep.time import Timestamp
    from lockstep.trainer import rejoin

    out = {}
    for name, ranks in CASES.items():
        batch, took, can = ranks[dist.get_global_rank()]
        state = SimpleNamespace(timestamp=Timestamp(batch=batch or 0))
        out[name] = rejoin.peers_hold_the_state(state, (4, 4, False) if took else None, can, fresh=batch is None)
    return out


def test_the_ranks_that_trained_give_the_state_only_when_none_was_lost_and_all_got_equally_far() -> None:
    results = run_distributed(_decide, world_size=3, args=(0,), timeout=120)
    assert all(r == results[0] for r in results)  # one decision for every rank
    assert results[0] == {"joined, the others equally far": True, "joined, both took the step in flight": True,
                          "one took the step in flight, one not": False, "a rank that held a shard was lost": False,
                          "one a batch behind": False}


# Per case, each of 3 ranks: None for a rank that joined, else (steps of the batch's end taken,
# or None for no end in flight; whether the batch ended an epoch)
ENDS = {
    "one joined while two were at step 2": [None, (2, True), (2, True)],
    "none in flight": [None, (None, False), (None, False)],
    "two at different steps of a batch's end": [(1, False), (2, False), (2, False)],
    "two at different steps of an epoch's end": [None, (1, True), (2, True)],
}


def _ends(_: int) -> dict[str, object]:
    from lockstep import dist
    from lockstep.time import Timestamp
    from lockstep.trainer import rejoin
    from lockstep.trainer.batch_end import BatchEnd

    out: dict[str, object] = {}
    for name, ranks in ENDS.items():
        mine = ranks[dist.get_global_rank()]
        tail = None
        if mine is not None and mine[0] is not None:
            tail = BatchEnd([print] * 5, mine[1], Timestamp(batch=3), Timestamp(batch=4))
            tail.taken = mine[0]
        try:
            taken, made_from = rejoin.end_pending(tail, mine is None, 4)
            out[name] = (taken, None if made_from is None else (made_from[0]["batch"], made_from[1]["batch"],
                                                                made_from[2]))
        except RuntimeError as error:
            out[name] = str(error)
    return out


def test_a_batch_end_is_taken_up_where_the_ranks_that_trained_agree_and_a_rank_that_joined_follows_them() -> None:
    results = run_distributed(_ends, world_size=3, args=(0,), timeout=120)
    assert all(r == results[0] for r in results), results  # every rank, the one that joined too, the same
    ends = results[0]
    assert ends["one joined while two were at step 2"] == (2, (3, 4, True))
    assert ends["none in flight"] == (-1, None)
    assert ends["two at different steps of a batch's end"] == (-1, None)
    refused = ends["two at different steps of an epoch's end"]
    assert "different steps of the end of batch 4, the last of its epoch" in refused, refused
