"""The master's launcher answering a lost node's launcher started again (issue 51, grow), on a real
c10d store: the node is let in once its ranks are ready, never twice, not after its launcher took
the request back, not while the job finishes (and ranks let in just before leave), and a newer
launcher's request replaces an older one. A job that starts without a node late for the last
call: every launcher follows the master's decision, and the late node is let in once the ranks
the job started with follow its membership. A torchrun script's job lets a node in by starting
every rank again.
The whole join, with processes, is in test_nodes.py."""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as torch_dist

from lockstep import regroup
from lockstep.launcher.elastic_names import RESTART, elastic_prefix, generation_key, members_key, plain_key, ready_key
from lockstep.launcher.job import JobChannel
from lockstep.launcher.membership import Members, admission, ask_to_join, was_let_go, withdraw

PER_NODE = 2


@pytest.fixture
def store() -> Iterator[Any]:
    server = torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10))
    yield server


def call(store: Any):
    """The launchers' ``call(name, *args)`` over a store client."""
    return lambda name, *args: getattr(store, name)(*args)


def two_nodes_after_node_1_was_lost(store: Any) -> Members:
    members = Members(store, 0, [0, 1, 2, 3], minimum=2, per_node=PER_NODE)
    store.add(elastic_prefix(0) + "joined", 4)  # every rank follows a change (their Membership says so)
    assert members.lose_node(1, 3.1)
    return members


def ready(store: Any, token: str, ranks: int = PER_NODE) -> None:
    store.add(ready_key(elastic_prefix(0), token), ranks)


def published(store: Any) -> list[int]:
    prefix = elastic_prefix(0)
    return json.loads(store.get(members_key(prefix, int(store.add(generation_key(prefix), 0)))))


def test_a_lost_node_is_let_in_once_every_rank_of_its_new_launcher_is_ready(store: Any) -> None:
    members = two_nodes_after_node_1_was_lost(store)
    assert was_let_go(call(store), 0, 1) and not was_let_go(call(store), 0, 0)
    token = ask_to_join(call(store), 0, 1)
    assert members.answer() == [] and admission(call(store), 0, token) is None
    ready(store, token, 1)
    assert members.answer() == [] and published(store) == [0, 1]  # one of its two ranks is not ready
    ready(store, token, 1)
    assert members.answer() == [1]
    assert admission(call(store), 0, token) == 2 and published(store) == [0, 1, 2, 3]
    assert not was_let_go(call(store), 0, 1)
    again = ask_to_join(call(store), 0, 1)  # its ranks train: no second launcher joins for it
    members.answer()
    assert admission(call(store), 0, again) == "node 1's ranks were not let go by the job"


def test_a_request_taken_back_before_the_ranks_were_ready_lets_nothing_in(store: Any) -> None:
    members = two_nodes_after_node_1_was_lost(store)
    token = ask_to_join(call(store), 0, 1)
    members.answer()
    assert withdraw(call(store), 0, token, "rank 2 failed")
    ready(store, token)
    assert members.answer() == [] and published(store) == [0, 1]
    assert admission(call(store), 0, token) == "withdrawn (rank 2 failed)"
    later = ask_to_join(call(store), 0, 1)  # the node may still come back
    ready(store, later)
    assert members.answer() == [1] and published(store) == [0, 1, 2, 3]
    assert not withdraw(call(store), 0, later, "too late")  # the master answered first: its ranks are the job's


def test_a_newer_launcher_of_the_node_replaces_one_whose_ranks_never_got_ready(store: Any) -> None:
    members = two_nodes_after_node_1_was_lost(store)
    killed = ask_to_join(call(store), 0, 1)
    ready(store, killed, 1)
    members.answer()
    newer = ask_to_join(call(store), 0, 1)
    members.answer()
    assert admission(call(store), 0, killed) == "another launcher of node 1 asked to join after it"
    ready(store, newer)
    assert members.answer() == [1] and admission(call(store), 0, newer) == 2


def test_no_node_joins_a_job_whose_master_ranks_finished(store: Any) -> None:
    members = two_nodes_after_node_1_was_lost(store)
    waiting = ask_to_join(call(store), 0, 1)
    members.answer()
    members.finishing = True
    ready(store, waiting)
    assert members.answer() == [] and published(store) == [0, 1]
    assert admission(call(store), 0, waiting) == "the job is finishing"
    late = ask_to_join(call(store), 0, 1)
    members.answer()
    assert admission(call(store), 0, late) == "the job is finishing"


def test_a_node_that_asks_to_join_a_torchrun_scripts_job_is_answered_that_every_rank_starts_again(
        store: Any) -> None:
    """The job's ranks follow no change of the membership (a script that calls init_process_group
    itself, as the joining node's ranks say of their own): the node is let in as torchrun lets a
    node in, every node starting its ranks again; no generation is published."""
    members = Members(store, 0, [0, 1, 2, 3], minimum=2, per_node=PER_NODE)
    members.start_without([1], 1.0)
    token = ask_to_join(call(store), 0, 1)
    assert members.answer() == [] and admission(call(store), 0, token) is None and members.restart_for == []
    store.set(plain_key(elastic_prefix(0), token), "1")  # a rank of it reached its own init_process_group
    assert members.answer() == [] and members.restart_for == [1]
    assert admission(call(store), 0, token) == RESTART and published(store) == [0, 1]


def test_a_job_whose_ranks_follow_lets_in_a_node_whose_script_also_forms_its_group_itself(store: Any) -> None:
    members = two_nodes_after_node_1_was_lost(store)  # every rank follows (a Trainer after init_process_group)
    token = ask_to_join(call(store), 0, 1)
    store.set(plain_key(elastic_prefix(0), token), "1")
    ready(store, token)
    assert members.answer() == [1] and members.restart_for == [] and admission(call(store), 0, token) == 2


def test_ranks_let_in_as_the_job_finishes_leave_at_once_and_well(store: Any) -> None:
    """The master's ranks finished training just after it let a node in: the node's ranks, waiting
    for the others to form the new group, exit 0 instead of waiting ``dist_timeout`` for them."""
    members = two_nodes_after_node_1_was_lost(store)
    token = ask_to_join(call(store), 0, 1)
    ready(store, token)
    assert members.answer() == [1]
    members.finish()
    started = time.monotonic()
    with pytest.raises(regroup.JobFinished) as left:
        regroup._all_arrived(store, elastic_prefix(0), 2, 4, 300.0, lambda: 2)
    assert left.value.code == 0 and "nothing is left to train" in left.value.message
    assert time.monotonic() - started < 5


def test_the_master_starts_without_a_node_late_for_the_last_call_and_lets_it_in_once_the_others_follow(
        store: Any) -> None:
    channels = [JobChannel.connect("127.0.0.1", store.port, node, 3, server=store if node == 0 else None)
                for node in range(3)]
    begun: dict[int, list[int]] = {}
    enough = {"enough": lambda nodes: nodes >= 2, "last_call": 0.5}  # the master's, of --nnodes 2:3
    threads = [threading.Thread(target=lambda n=n, kw=kw: begun.update({n: channels[n].begin(0, 30, **kw)}))
               for n, kw in ((0, enough), (1, {}))]
    try:
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert begun == {0: [], 1: []} and time.monotonic() - started >= 0.5
        assert channels[0].without == channels[1].without == [2]
        assert channels[2].begin(0, 30) == [] and channels[2].without == [2]  # late: it joins the running job
        assert channels[0]._counts()[0][2] >= 0  # the late node's counters exist (a read would wait for them)
    finally:
        for channel in channels:
            channel.close()
    members = Members(store, 0, list(range(6)), minimum=2, per_node=PER_NODE)
    members.start_without([2], 0.5)
    assert published(store) == [0, 1, 2, 3] and was_let_go(call(store), 0, 2)
    token = ask_to_join(call(store), 0, 2)
    ready(store, token)
    assert members.answer() == []  # the ranks the job started with do not follow its membership yet
    store.add(elastic_prefix(0) + "joined", 4)
    assert members.answer() == [2] and published(store) == [0, 1, 2, 3, 4, 5]
    assert admission(call(store), 0, token) == 2


def test_a_rank_started_again_in_place_is_let_in_once_ready_and_once_the_others_formed_their_group(
        store: Any) -> None:
    """``--rank_restarts``: rank 2 (node 1) is lost, and its launcher starts it again. It is let in
    once it is ready and every rank left made the change to the generation without it (else they
    would skip it); a rank that trains is not let in twice, and a newer start of a rank replaces an older one."""
    members = Members(store, 0, [0, 1, 2, 3], minimum=2, per_node=PER_NODE)
    store.add(elastic_prefix(0) + "joined", 4)
    assert members.lose(2, -9) and published(store) == [0, 1, 3]
    assert not was_let_go(call(store), 0, 1)  # the rank, not its node
    first = ask_to_join(call(store), 0, 1, [2])
    token = ask_to_join(call(store), 0, 1, [2])  # it died again, and was started again
    assert members.answer() == [] and admission(call(store), 0, first) == "rank 2 was started again after it"
    ready(store, token, 1)
    assert members.answer() == [] and members.waiting  # the three have not made the change to generation 1 yet
    store.add(elastic_prefix(0) + "g1/settled", 3)
    assert members.answer() == [1] and not members.waiting
    assert admission(call(store), 0, token) == 2 and published(store) == [0, 1, 2, 3]  # back in its place
    again = ask_to_join(call(store), 0, 1, [2])
    members.answer()
    assert admission(call(store), 0, again) == "rank 2 is not let go by the job, or its node is"


def test_with_one_rank_a_node_a_rank_started_again_is_still_a_rank_and_goes_back_in_its_place(store: Any) -> None:
    """One rank per node: a rank's request is not taken for its node's (it waits for the others to
    form their group, and goes back in its place, not after them), and a request withdrawn as its
    rank died before it was let in is never let in."""
    members = Members(store, 0, [0, 1, 2], minimum=1, per_node=1)
    store.add(elastic_prefix(0) + "joined", 3)
    assert members.lose(1, -9) and published(store) == [0, 2]
    died = ask_to_join(call(store), 0, 1, [1])
    ready(store, died, 1)
    assert withdraw(call(store), 0, died, "rank 1 exited first")
    token = ask_to_join(call(store), 0, 1, [1])
    ready(store, token, 1)
    assert members.answer() == [] and members.waiting  # the two have not made the change to generation 1 yet
    store.add(elastic_prefix(0) + "g1/settled", 2)
    assert members.answer() == [1] and admission(call(store), 0, token) == 2 and published(store) == [0, 1, 2]
    assert admission(call(store), 0, died) == "withdrawn (rank 1 exited first)"
