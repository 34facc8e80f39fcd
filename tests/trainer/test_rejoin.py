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
    "one took the step in flight, one ended it too": [(None, False, True), (5, True, True), (6, False, True)],
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


def test_the_ranks_that_trained_give_the_state_only_when_none_was_lost_and_all_took_the_same_steps() -> None:
    results = run_distributed(_decide, world_size=3, args=(0,), timeout=120)
    assert all(r == results[0] for r in results)  # one decision for every rank
    assert results[0] == {"joined, the others equally far": True, "joined, both took the step in flight": True,
                          "one took the step in flight, one not": False, "a rank that held a shard was lost": False,
                          "one a batch behind": False, "one took the step in flight, one ended it too": True}
