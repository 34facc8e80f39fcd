"""What ``srun lockstep -n N script`` takes from SLURM: nodes, this node's rank, the master and a port.

Under srun with one task per node, Slurm tells each task how many nodes its step has
(``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``), which of them it runs on (``SLURM_NODEID``) and
their host names (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``, in Slurm's compressed
hostlist syntax). cli.py uses these only for what the command line and the usual variables
(``WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) leave unset. Parsing only, and one
call to the system resolver for the master's address.
"""

from __future__ import annotations

import itertools
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from lockstep.launcher import resolver
from lockstep.launcher.plan import LaunchError

PORT_BASE = 15000
"""Ports derived from SLURM_JOB_ID lie in PORT_BASE .. PORT_BASE + PORT_SPAN - 1: above the
well-known and registered services most clusters run, below Linux's ephemeral range (32768 up)
from which outgoing connections take their ports."""
PORT_SPAN = 10000
_MAX_HOSTS = 65536  # as Slurm: a larger range is a typo, not a cluster
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_SEPARATORS = ", \t\n"


def expand_hostlist(text: str) -> list[str]:
    """Every host of a Slurm hostlist, in order: ``node[01-03,07]`` -> node01 node02 node03 node07.

    As Slurm's own parser: hosts are separated by commas or white space (commas inside brackets
    separate ranges); a range ``lo-hi`` keeps the zero padding of ``lo`` (``[08-10]`` -> 08 09 10,
    ``[8-10]`` -> 8 9 10); text may follow the brackets (``gpu-[1-2]-ib``); several bracket groups
    multiply, the leftmost varying slowest (``r[1-2]n[3-4]`` -> r1n3 r1n4 r2n3 r2n4). ValueError
    says what is wrong.
    """
    hosts: list[str] = []
    for token in _tokens(text):
        hosts.extend(_expand(token))
        if len(hosts) > _MAX_HOSTS:
            raise ValueError(f"more than {_MAX_HOSTS} hosts")
    if not hosts:
        raise ValueError("no host in it")
    return hosts


def _tokens(text: str) -> list[str]:
    tokens, current, depth = [], "", 0
    for char in text:
        if char == "[":
            if depth:
                raise ValueError("brackets inside brackets")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError("a ']' without its '['")
            depth = 0
        if char in _SEPARATORS and not depth:
            tokens.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError("a '[' without its ']'")
    return [t for t in [*tokens, current] if t]


def _expand(token: str) -> list[str]:
    parts = _GROUP.split(token)  # literal, group, literal, group, ..., literal
    literals, groups = parts[0::2], parts[1::2]
    return ["".join(itertools.chain.from_iterable(itertools.zip_longest(literals, numbers, fillvalue="")))
            for numbers in itertools.product(*(_numbers(group) for group in groups))]


def _numbers(group: str) -> list[str]:
    numbers: list[str] = []
    for item in group.split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or not lo.isascii() or not hi.isascii():
            raise ValueError(f"[{group}] holds {item!r}, not a number or a range like 1-4")
        low, high = int(lo), int(hi or lo)
        if low > high:
            raise ValueError(f"the range {item} runs backwards")
        if high - low >= _MAX_HOSTS:
            raise ValueError(f"the range {item} has more than {_MAX_HOSTS} hosts")
        numbers.extend(str(n).zfill(len(lo)) for n in range(low, high + 1))
    return numbers


@dataclass(frozen=True)
class SlurmStep:
    """The SLURM variables of one srun task; each is parsed (and checked) when it is first used."""

    env: Mapping[str, str]

    def _first(self, *names: str) -> tuple[str, str]:
        for name in names:
            if self.env.get(name):
                return name, self.env[name]
        raise LaunchError(f"SLURM job without {' or '.join(names)}: pass the value as a flag instead")

    def _int(self, *names: str) -> tuple[str, int]:
        name, text = self._first(*names)
        if not text.strip().isdigit():
            raise LaunchError(f"env {name}: expected a number, got {text!r}")
        return name, int(text)

    @property
    def nnodes(self) -> int:
        """The step's nodes, checked: one lockstep per node, started by srun."""
        name, nnodes = self._int("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        if nnodes < 1:
            raise LaunchError(f"env {name}: expected at least 1 node, got {nnodes}")
        if nnodes > 1 and not self.env.get("SLURM_STEP_NUM_NODES"):
            raise LaunchError(
                f"SLURM allocated {nnodes} nodes, but this lockstep was not started by srun: start one "
                f"per node with `srun --ntasks-per-node=1 lockstep ...`, or pass --nnodes 1 to use this node only")
        tasks = self.env.get("SLURM_STEP_NUM_TASKS", "")
        if tasks.isdigit() and int(tasks) > nnodes:
            raise LaunchError(
                f"srun started {tasks} tasks on {nnodes} node(s), and each would start its own ranks: run one "
                f"lockstep per node (srun --ntasks-per-node=1) and give it the ranks per node with -n")
        hosts = self.hosts
        if len(hosts) != nnodes:
            raise LaunchError(f"env {name} says {nnodes} nodes but {self.hostlist_name} names {len(hosts)}: "
                              f"pass --nnodes and --master_addr instead")
        return nnodes

    @property
    def node_rank(self) -> int:
        return self._int("SLURM_NODEID")[1]

    @property
    def hostlist_name(self) -> str:
        return self._first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")[0]

    @property
    def hosts(self) -> list[str]:
        name, text = self._first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        try:
            return expand_hostlist(text)
        except ValueError as e:
            raise LaunchError(f"env {name} {text!r} is not a Slurm hostlist ({e}): pass --master_addr") from None

    @property
    def master_host(self) -> str:
        """The first host of the step: srun numbers the nodes in the hostlist's order."""
        return self.hosts[0]

    @property
    def master_port(self) -> int:
        """A port derived from the job id: the same on every node of the job, different for the
        next 9999 jobs."""
        return PORT_BASE + self._int("SLURM_JOB_ID")[1] % PORT_SPAN


def step(env: Mapping[str, str]) -> SlurmStep | None:
    """This srun task's SLURM variables, or None when the launcher does not run as a SLURM task."""
    if not env.get("SLURM_JOB_ID") or not env.get("SLURM_NODEID"):
        return None  # not in a job, or in an allocation's shell where no task was started (salloc)
    return SlurmStep(env)


def resolve(host: str, source: str) -> str:
    """The IPv4 address of ``host`` (the store listens on IPv4), else any address of it."""
    for family in (socket.AF_INET, socket.AF_UNSPEC):
        try:
            return resolver.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0]
        except resolver.Unresolved as e:
            error = e
            if e.timed_out:  # the name server does not answer: asking again only waits again
                break
    raise LaunchError(f"the master host {host!r} ({source}) {error.detail}: set MASTER_ADDR or --master_addr to "
                      f"its address")
