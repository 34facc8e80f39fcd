"""The process group of one generation of an elastic job's ranks, formed in the store the master's
launcher hosts: by the ranks left after a loss (:mod:`lockstep.elastic.membership`), and by a rank
that joins a running job (a node's launcher started again, ``LOCKSTEP_ELASTIC_JOIN``), which
:func:`lockstep.dist.initialize_dist` has enter the newest generation instead of the launch's group.

Generation g's ranks first count themselves in ``<prefix>g<g>/arrived``; only once every one of
them arrived do they start gloo's rendezvous under ``<prefix>g<g>/``, which would wait for a lost
rank for its whole timeout. A newer generation published meanwhile (a rank lost during the
re-form) is formed instead.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as torch_dist
from torch.distributed import distributed_c10d

from lockstep.launcher.elastic_names import (
    ELASTIC_ENV,
    ELASTIC_STORE_ENV,
    JOIN_ENV,
    RESPAWN_ENV,
    START_ENV,
    admit_key,
    finished_key,
    generation_key,
    members_key,
    plain_key,
    ready_key,
)

POLL_S = 0.05


class JobFinished(SystemExit):
    """The job's ranks finished training while this rank waited to form a process group with them
    (it was let in just before): it exits 0, saying so."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message
        print(message, file=sys.stderr, flush=True)


def client() -> Any:
    """A client of the store where the membership is (one per thread: a client is not shared)."""
    where = os.environ.get(ELASTIC_STORE_ENV) or f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    host, _, port = where.rpartition(":")
    return torch_dist.TCPStore(host.strip("[]"), int(port), None, False, timedelta(seconds=60))


def newest(store: Any, prefix: str) -> int:
    """The newest generation the launcher published."""
    return int(store.add(generation_key(prefix), 0))


def members(store: Any, prefix: str, generation: int) -> list[int]:
    """Generation ``generation``'s ranks, by the rank each had at launch, in their order there."""
    return json.loads(store.get(members_key(prefix, generation)))


def form(store: Any, prefix: str, launch_rank: int, timeout: float,
         newest_seen: Callable[[], int]) -> tuple[int, list[int]]:
    """Make the default process group one of the newest generation's ranks (its rank and world
    size then in ``RANK``/``WORLD_SIZE``); that generation and its ranks. ``newest_seen`` tells
    the newest generation published while this rank waits for the others to arrive."""
    while True:
        generation = newest(store, prefix)
        ranks = members(store, prefix, generation)
        if launch_rank not in ranks:
            raise RuntimeError(f"rank {launch_rank} (at launch) is not in generation {generation} of the job's "
                               f"ranks {ranks}: the launcher counted it as lost")
        if _all_arrived(store, prefix, generation, len(ranks), timeout, newest_seen):
            break
    rank, world = ranks.index(launch_rank), len(ranks)
    group_store = torch_dist.PrefixStore(f"{prefix}g{generation}/", client())
    torch_dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world,
                                  timeout=timedelta(seconds=timeout))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    return generation, ranks


def _all_arrived(store: Any, prefix: str, generation: int, world: int, timeout: float,
                 newest_seen: Callable[[], int]) -> bool:
    """Wait until every rank of ``generation`` arrived to form its group: True; False as soon as
    the launcher publishes a newer generation (one of them was lost meanwhile)."""
    key = f"{prefix}g{generation}/arrived"
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while int(store.add(key, 0)) < world:
        if newest_seen() > generation:
            return False
        if store.check([finished_key(prefix)]):
            raise JobFinished(f"lockstep: rank {os.environ.get('RANK')} was let into the running job as its ranks "
                              f"finished training: nothing is left to train, it exits")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every rank of generation {generation} of the job's ranks arrived to form "
                               f"its process group within {timeout:g} s (dist_timeout)")
        time.sleep(POLL_S)
    return True


entered: tuple[int, list[int]] | None = None
"""The generation, and its ranks, that this process joined the running job in (see :func:`enter`),
or started in (see :func:`start`)."""
started = False
"""Whether :data:`entered` is the generation the job started in, without some of its nodes."""


def joining() -> bool:
    """Whether this rank was started to join a running elastic job (its launcher rejoined it)."""
    return bool(os.environ.get(JOIN_ENV)) and bool(os.environ.get(ELASTIC_ENV))


def starting() -> bool:
    """Whether this rank's job started without some of its nodes (``LOCKSTEP_ELASTIC_START``)."""
    return bool(os.environ.get(START_ENV)) and bool(os.environ.get(ELASTIC_ENV))


def start(timeout: float) -> None:
    """The default process group of the newest generation, which the job started in without some
    of its nodes: every rank of it starts here, and no rank has trained yet."""
    global entered, started
    store, prefix = client(), os.environ[ELASTIC_ENV]
    entered = form(store, prefix, int(os.environ["RANK"]), timeout, lambda: newest(store, prefix))
    started = True


def enter(timeout: float, *, plain: bool = False) -> None:
    """Join the running job: say this rank is ready, and once the master's launcher has let its
    node in (every rank of the node ready), the default process group of the generation with it.
    ``plain``: the script forms its group itself (torchrun's way); the master then has every node
    start its ranks again instead, and this one is stopped by its launcher while it waits."""
    global entered
    store, prefix, launch_rank = client(), os.environ[ELASTIC_ENV], int(os.environ["RANK"])
    if plain:
        store.set(plain_key(prefix, os.environ[JOIN_ENV]), "1")
    store.add(ready_key(prefix, os.environ[JOIN_ENV]), 1)
    deadline = time.monotonic() + timeout
    while launch_rank not in members(store, prefix, newest(store, prefix)):
        if os.environ.get(RESPAWN_ENV):
            _stop_if_refused(store, prefix, launch_rank)
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {launch_rank} (at launch) was not let into the running job within {timeout:g} s "
                               f"(dist_timeout): see its launcher's output")
        time.sleep(POLL_S)
    entered = form(store, prefix, launch_rank, timeout, lambda: newest(store, prefix))


def _stop_if_refused(store: Any, prefix: str, launch_rank: int) -> None:
    """A rank started again in place that the master's launcher will not let in exits, saying why."""
    if store.check([finished_key(prefix)]):
        raise JobFinished(f"lockstep: rank {launch_rank} (at launch), started again, finds the job's ranks done "
                          f"training: nothing is left to train, it exits")
    key = admit_key(prefix, os.environ[JOIN_ENV])
    if store.check([key]):
        answer = store.get(key).decode()
        if answer.startswith("no: "):
            print(f"lockstep: rank {launch_rank} (at launch), started again, was not let into the running job: "
                  f"{answer.removeprefix('no: ')}", file=sys.stderr, flush=True)
            raise SystemExit(1)


def route_init_process_group() -> None:
    """Have the script's own ``torch.distributed.init_process_group()`` (the ``env://`` rendezvous)
    form this rank's group as :func:`lockstep.dist.initialize_dist` does, in a rank that starts
    without some nodes (:func:`start`) or joins a running job (:func:`enter`): the launch's
    ``env://`` group would wait for the ranks of every node. The worker bootstrap installs it."""
    original = torch_dist.init_process_group

    @functools.wraps(original)
    def init_process_group(backend: Any = None, init_method: str | None = None, timeout: timedelta | None = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, **kwargs: Any) -> None:
        if store is not None or init_method not in (None, "env://") or torch_dist.is_initialized():
            return original(backend, init_method, timeout, world_size, rank, store, **kwargs)
        if backend not in (None, "gloo", "cpu:gloo"):
            raise ValueError(f"init_process_group(backend={backend!r}) in an elastic job (--min_ranks, --nnodes "
                             f"MIN:MAX) that started without some nodes or joins a running job: its ranks form "
                             f"their process group over gloo; use backend='gloo'")
        seconds = (timeout or torch_dist.default_pg_timeout).total_seconds()
        if joining():
            enter(seconds, plain=True)
        else:
            start(seconds)

    torch_dist.init_process_group = distributed_c10d.init_process_group = init_process_group  # the name either way
