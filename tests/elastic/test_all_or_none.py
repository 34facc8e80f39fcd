"""Membership.all_or_none on a real c10d store (issue 51): after a waited collective that some ranks
completed while another gave it up, every rank of the generation goes on, or none does, decided
once. Without it, 3 of 12 launches of test_shrink.py's rank_restarts job under ZeRO-2 hung in the
save's own collectives, and under DDP a join during an epoch's last save could stop the job (rank 0
wrote the checkpoint alone)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as torch_dist

from lockstep.elastic.membership import Membership, MembershipChanged

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store() -> Iterator[Any]:
    yield torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10))


def _ranks(store: Any, world: int) -> list[Membership]:
    """Each rank's view of generation 1 of ``world`` ranks, without a process group or a watcher:
    the test moves ``_newest`` itself, as the watcher does when the launcher publishes."""
    views = []
    for rank in range(world):
        view = object.__new__(Membership)
        view.prefix, view.launch_rank, view.generation, view.ranks = "job/", rank, 1, list(range(world))
        view._newest, view._points = 1, {}
        view._store = torch_dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
        views.append(view)
    return views


def _meet(views: list[Membership]) -> dict[int, str]:
    """Each view's all_or_none in a thread of its own: 'go' or 'stop', by rank."""
    outcome: dict[int, str] = {}

    def one(view: Membership) -> None:
        try:
            view.all_or_none("the test's collectives")
            outcome[view.launch_rank] = "go"
        except MembershipChanged:
            outcome[view.launch_rank] = "stop"

    threads = [threading.Thread(target=one, args=(view,)) for view in views]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcome


def test_every_rank_goes_on_once_all_arrived_and_each_meeting_is_decided_anew(store: Any) -> None:
    views = _ranks(store, 3)
    assert _meet(views) == {0: "go", 1: "go", 2: "go"}
    assert _meet(views) == {0: "go", 1: "go", 2: "go"}
    assert [view._points for view in views] == [{1: 2}] * 3


def test_ranks_that_wait_for_one_that_gave_up_stop_together_when_the_change_comes(store: Any) -> None:
    views = _ranks(store, 3)
    waiting = threading.Thread(target=lambda: setattr(views[1], "_newest", 2))
    timer = threading.Timer(0.3, waiting.start)  # the change seen by one of the two that wait
    timer.start()
    assert _meet(views[:2]) == {0: "stop", 1: "stop"}  # rank 2 gave up the collective and never comes
    timer.join()
