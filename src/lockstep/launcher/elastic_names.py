"""The names an elastic job's launchers and its ranks share (``--min_ranks``, ``--nnodes MIN:MAX``):
environment variables and the store keys of the membership. Torch-free, so that the launcher starts fast."""

from __future__ import annotations

ELASTIC_ENV = "LOCKSTEP_ELASTIC"
"""The store key prefix of an attempt's membership; set in every rank of an elastic job."""
ELASTIC_STORE_ENV = "LOCKSTEP_ELASTIC_STORE"
"""``host:port`` of the store the master's launcher hosts for the whole job, where the membership
is (a restart's ranks rendezvous in a fresh store of their own on several nodes)."""
FULL_WORLD_ENV = "LOCKSTEP_FULL_WORLD_SIZE"
"""The ranks a global batch is made for (the launcher sets it in an elastic job); fewer may train on it."""
JOIN_ENV = "LOCKSTEP_ELASTIC_JOIN"
"""Set in the ranks a launcher starts to join a running elastic job (its node was lost, and its
launcher started again), to its request's token: they enter the first generation with them rather
than the launch's process group."""
RESPAWN_ENV = "LOCKSTEP_ELASTIC_RESPAWN"
"""Set (with :data:`JOIN_ENV`) in a rank its launcher started again in place (``--rank_restarts``):
refused by the master's launcher, it exits rather than wait to be let in."""
START_ENV = "LOCKSTEP_ELASTIC_START"
"""Set in the ranks of a job that started without some of its nodes (they did not join in time):
they form the newest generation's process group, of the ranks there are, rather than the launch's."""


def elastic_prefix(attempt: int) -> str:
    """The store keys of an elastic attempt's membership."""
    return f"lockstep/elastic/attempt{attempt}/"


def members_key(prefix: str, generation: int) -> str:
    """Generation ``generation``'s ranks (numbered as at launch, in their new order), as JSON."""
    return f"{prefix}members{generation}"


def generation_key(prefix: str) -> str:
    """The count of generations: the newest one."""
    return f"{prefix}generation"


def joined_key(prefix: str) -> str:
    """The count of ranks that follow a change of the membership."""
    return f"{prefix}joined"


def lost_key(prefix: str) -> str:
    """The ranks other nodes lost, one JSON line ``[rank, exit code]`` each, for the master's launcher."""
    return f"{prefix}lost"


def answer_key(prefix: str, loss: int | str) -> str:
    """The master's answer about a lost rank (by the key its launcher sent with the loss):
    ``go`` (the job goes on without it) or ``stop``."""
    return f"{prefix}answer{loss}"


def gone_key(prefix: str, node: int) -> str:
    """Set once the job went on without node ``node``: a launcher started again for it joins the
    running attempt instead of waiting for the next one."""
    return f"{prefix}gone{node}"


def join_key(prefix: str) -> str:
    """The requests of launchers that ask to join the running job, one JSON line ``[node, token]``
    each, for the master's launcher (the token names the request's keys)."""
    return f"{prefix}join"


def finished_key(prefix: str) -> str:
    """Set once the master's ranks finished training: ranks that were let in to join just before
    leave instead of waiting for a process group the others never form."""
    return f"{prefix}finished"


def ready_key(prefix: str, token: str) -> str:
    """The count of a joining node's ranks ready to enter the job: the master lets the node in once
    every one is, so that the ranks that train do not wait for the new ones to start."""
    return f"{prefix}ready-{token}"


def plain_key(prefix: str, token: str) -> str:
    """Set by a joining node's rank whose script forms its process group itself (a torchrun script,
    calling ``init_process_group``): the job's ranks, which run the same script, follow no change of
    the membership, so the master lets the node in as torchrun does, by starting every rank again."""
    return f"{prefix}plain-{token}"


RESTART = "restart"
"""The answer to a request to join a job whose ranks follow no change of the membership: every node
starts its ranks again, the joining one with them (torchrun's agents restart for a new node too)."""


def admit_key(prefix: str, token: str) -> str:
    """The answer to a request to join: the generation the node joins in, or ``no: why`` (the
    master's refusal, or its launcher's withdrawal, whichever came first)."""
    return f"{prefix}admit-{token}"
