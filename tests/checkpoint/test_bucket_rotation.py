"""The bucket's own rotation record (lockstep.checkpoint.bucket_rotation), without a server: which
checkpoints go once a save is complete in the bucket, whatever the local rotation did meanwhile."""

from __future__ import annotations

import pytest

from lockstep.checkpoint.bucket_rotation import BucketRotation, left_earlier

NAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
PLACE = {"run_name": "r", "rank": 0, "local_rank": 0, "world_size": 2, "local_world_size": 2, "node_rank": 0}


def ba(n: int) -> str:
    return f"ep0-ba{n}-rank0.pt"


def _rotation(keep: int, *saved: int) -> BucketRotation:
    rotation = BucketRotation(keep)
    for n in saved:
        rotation.saved(ba(n))
    return rotation


def test_uploads_that_lag_behind_the_local_rotation_still_delete_the_oldest() -> None:
    """Issue 49: ba2 complete, then nothing until the end, where ba4 had been dropped from the
    queue and ba6 and ba8 are complete: ba2 goes too, though the local history no longer names it."""
    rotation = _rotation(2, 2, 4, 6, 8)
    assert rotation.settle([(ba(2), True)]) == []
    assert rotation.settle([(ba(4), False), (ba(6), True), (ba(8), True)]) == [ba(2), ba(4)]


@pytest.mark.parametrize(("keep", "removed"), [(1, [ba(2), ba(4)]), (2, [ba(2)]), (3, []), (-1, [])])
def test_keeps_the_newest_complete_ones(keep: int, removed: list[str]) -> None:
    rotation = _rotation(keep, 2, 4, 6)
    assert rotation.settle([(ba(2), True), (ba(4), True), (ba(6), True)]) == removed


def test_an_incomplete_older_save_goes_and_is_not_counted_as_kept() -> None:
    rotation = _rotation(2, 2, 4, 6)
    assert rotation.settle([(ba(2), True)]) == []
    # ba4 half uploaded (one rank dropped it): deleted, and ba2 stays as the second newest complete
    assert rotation.settle([(ba(4), False), (ba(6), True)]) == [ba(4)]
    rotation.saved(ba(8))
    assert rotation.settle([(ba(8), True)]) == [ba(2)]


def test_a_name_saved_again_after_the_settled_save_is_not_deleted() -> None:
    rotation = _rotation(1, 2, 4)
    rotation.saved(ba(2))  # saved again (a restart's leftover of that name, written over)
    assert rotation.settle([(ba(4), True)]) == []
    assert rotation.settle([(ba(2), True)]) == [ba(4)]


def test_an_earlier_attempt_counts_and_its_stale_names_go_first() -> None:
    rotation = BucketRotation(2)
    rotation.earlier(stale=[ba(12)], kept=[ba(2), ba(4), ba(6)])
    rotation.saved(ba(8))
    assert rotation.settle([(ba(8), True)]) == [ba(12), ba(2), ba(4)]


def test_left_earlier_splits_at_the_resumed_checkpoint_by_time() -> None:
    names = {ba(10), ba(2), "ep1-ba14-rank0.pt", ba(6), "latest-rank0.pt.symlink", "ep0-ba4-rank1.pt", "other"}
    assert left_earlier(names, NAME, PLACE, ba(6)) == (["ep0-ba10-rank0.pt", "ep1-ba14-rank0.pt"], [ba(2), ba(6)])
    assert left_earlier(names, NAME, PLACE, None) == ([ba(2), ba(6), ba(10), "ep1-ba14-rank0.pt"], [])
    # resumed from a checkpoint whose name tells no time (no save history): nothing counts as newer
    assert left_earlier(names, NAME, PLACE, "") == ([], [ba(2), ba(6), ba(10), "ep1-ba14-rank0.pt"])
