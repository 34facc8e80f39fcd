"""LaunchPlan: what the launcher will start on this node, derived purely from flags and env.

Nothing here starts a process, opens a socket or imports torch, so every rule is unit-testable.
"""

from __future__ import annotations

import math
import os
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, IntFlag
from pathlib import Path

from lockstep.launcher.elastic_names import ELASTIC_ENV, ELASTIC_STORE_ENV, FULL_WORLD_ENV, elastic_prefix

FORMAT_FIELDS = ("rank", "local_rank", "world_size", "node_rank", "local_world_size")
DEFAULT_STDOUT = "rank{rank}.stdout.log"
DEFAULT_STDERR = "rank{rank}.stderr.log"
ERROR_FILE = "rank{rank}.error.json"
DEFAULT_RDZV_TIMEOUT = 300.0
DEFAULT_RDZV_LAST_CALL = 30.0
"""torchrun's default ``last_call_timeout``."""
DEFAULT_LINE_PREFIX = "[${role_name}${local_rank}]:"
"""torchrun's prefix of a teed line (no space after it); TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
replaces it, with ${role_name}, ${rank} and ${local_rank}."""
# torchrun sets it in its ranks' environment: the signals its agent handles (lockstep's too).
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class LaunchError(ValueError):
    """A usage error: the launcher prints its message on one line and exits 2 before starting anything."""


class Stream(IntFlag):
    """A set of standard streams, numbered as torchrun's ``--tee`` and ``--redirects`` values."""

    NONE = 0
    STDOUT = 1
    STDERR = 2
    BOTH = 3


class Mode(str, Enum):
    SCRIPT = "script"
    MODULE = "module"
    COMMAND = "command"


@dataclass(frozen=True, slots=True)
class RankSpec:
    """One process this node will start."""

    rank: int
    local_rank: int
    stdout_path: Path | None
    """None: inherit the launcher's stdout (local rank 0)."""
    stderr_path: Path | None
    error_file: Path
    """Where torch's ``@record`` writes the rank's exception (TORCHELASTIC_ERROR_FILE)."""
    tee: Stream = Stream.NONE
    """Streams that go to their file and, each line prefixed with the rank, to the console."""
    prefix: str = ""
    """What each teed line starts with on the console, ``[default0]:`` as under torchrun."""
    links: tuple[tuple[Path, Path], ...] = ()
    """(name, file): with --log-dir, lockstep's names of the files torchrun's layout holds."""


PerRank = Stream | Mapping[int, Stream]
"""One value for every local rank, or torchrun's per-local-rank map (``0:3,1:1``; others: none)."""


def for_rank(value: PerRank, local_rank: int) -> Stream:
    """The streams ``value`` names for ``local_rank``."""
    return value if isinstance(value, Stream) else value.get(local_rank, Stream.NONE)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    """Everything the supervisor needs to start this node's ranks."""

    nproc: int
    world_size: int
    base_rank: int
    node_rank: int
    master_addr: str
    master_port: int | None
    """None: single node, the supervisor picks a free port and holds it."""
    run_directory: Path
    stdout_format: str | None
    stderr_format: str | None
    mode: Mode
    target: str
    target_args: tuple[str, ...] = ()
    verbose: bool = False
    max_restarts: int = 0
    grace_period: float = 5.0
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    rdzv_last_call: float = DEFAULT_RDZV_LAST_CALL
    """In an elastic job: seconds the master waits for the other nodes once enough joined."""
    """Seconds a node without rank 0 waits for the master's store before giving up."""
    tee: PerRank = Stream.NONE
    redirects: PerRank = Stream.NONE
    """Streams of local rank 0 that go to its files instead of the console."""
    tee_ranks: frozenset[int] | None = None
    """Local ranks whose teed lines reach the console (None: all); the others' go to files only."""
    run_id: str | None = None
    """TORCHELASTIC_RUN_ID; None: the run directory's name."""
    nnodes: int | None = None
    """Number of nodes when given (torchrun's --nnodes); else derived from world_size / nproc."""
    role: str = "default"
    line_prefix: str = DEFAULT_LINE_PREFIX
    """The template of a teed line's prefix (string.Template with role_name, rank, local_rank)."""
    torchrun_logs: Path | None = None
    """With --log-dir: ``<log dir>/<run_id>_<x>``, under which each attempt keeps torchrun's layout
    ``attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}``."""
    stall_timeout: float = 0.0
    """Seconds without progress from a reporting rank that end the job as a stall; 0: never."""
    notes: tuple[str, ...] = ()
    """Where settings came from that no flag gave (SLURM's variables); -v prints them."""
    advice: tuple[str, ...] = ()
    """Likely mistakes in the command line that are not errors (a launcher flag after the script);
    always printed."""
    min_ranks: int = 0
    """Elastic on one node: the ranks that must live for the job to go on after one is lost; 0: off."""
    rank_restarts: int = 0
    """Elastic: how many times each lost rank is started again in place, to join the running job."""
    python: str = field(default=sys.executable)

    @property
    def is_multinode(self) -> bool:
        return self.world_size > self.nproc

    @property
    def hosts_store(self) -> bool:
        """The node holding global rank 0 hosts the c10d store that every rank connects to."""
        return self.base_rank == 0

    @property
    def ranks(self) -> list[RankSpec]:
        """This node's ranks as the first attempt starts them."""
        return self.rank_specs(0)

    def rank_specs(self, attempt: int) -> list[RankSpec]:
        """This node's ranks in ``attempt`` (0 first; with --log-dir each has its own files)."""
        return [self._rank_spec(local_rank, attempt) for local_rank in range(self.nproc)]

    @property
    def group_world_size(self) -> int:
        """Number of nodes (torchrun's GROUP_WORLD_SIZE); nodes of unequal size need --nnodes."""
        return self.nnodes or math.ceil(self.world_size / self.nproc)

    def _rank_spec(self, local_rank: int, attempt: int = 0) -> RankSpec:
        rank = self.base_rank + local_rank
        fields = self.format_fields(local_rank)
        tee = for_rank(self.tee, local_rank)
        to_file = Stream.BOTH if local_rank else for_rank(self.redirects, 0) | tee
        stdout = stderr = None
        if to_file & Stream.STDOUT:
            stdout = Path((self.stdout_format or str(self.run_directory / DEFAULT_STDOUT)).format(**fields))
        if to_file & Stream.STDERR:
            stderr = Path((self.stderr_format or str(self.run_directory / DEFAULT_STDERR)).format(**fields))
        error_file = self.error_file(rank, attempt)
        links: tuple[tuple[Path, Path], ...] = ()
        if self.torchrun_logs is not None:  # torchrun's files are the rank's; lockstep's names link to them
            folder = error_file.parent
            ours: dict[Path, Path] = {}
            if stdout is not None:
                ours[stdout] = folder / "stdout.log"
                stdout = folder / "stdout.log"
            if stderr is not None:
                ours.setdefault(stderr, folder / "stderr.log")  # one name for both streams: stdout's
                stderr = folder / "stderr.log"
            links = tuple(ours.items())
        shown = self.tee_ranks is None or local_rank in self.tee_ranks
        prefix = string.Template(self.line_prefix).safe_substitute(
            role_name=self.role, rank=rank, local_rank=local_rank)
        return RankSpec(rank, local_rank, stdout, stderr, error_file, tee if shown else Stream.NONE, prefix, links)

    def error_file(self, rank: int, attempt: int = 0) -> Path:
        """TORCHELASTIC_ERROR_FILE of a rank: in the run directory, or torchrun's layout with --log-dir."""
        if self.torchrun_logs is not None:
            path = self.torchrun_logs / f"attempt_{attempt}" / str(rank - self.base_rank) / "error.json"
        else:
            path = self.run_directory / ERROR_FILE.format(rank=rank)
        # Absolute: a script may change its working directory before it fails.
        return Path(os.path.abspath(path))

    def format_fields(self, local_rank: int) -> dict[str, int]:
        return {
            "rank": self.base_rank + local_rank,
            "local_rank": local_rank,
            "world_size": self.world_size,
            "node_rank": self.node_rank,
            "local_world_size": self.nproc,
        }

    def command(self) -> list[str]:
        """The argv each worker runs; python targets go through lockstep's small worker bootstrap."""
        if self.mode is Mode.COMMAND:
            return [self.target, *self.target_args]
        bootstrap = [self.python, "-u", "-m", "lockstep.launcher.worker", self.mode.value]
        return [*bootstrap, self.target, *self.target_args]

    def _elastic_env(self, env: dict[str, str], restart_count: int, store_port: int) -> None:
        """An elastic job's names: the attempt's membership keys, the store that holds them (the
        launcher's), the world the global batch is made for."""
        env[ELASTIC_ENV] = elastic_prefix(restart_count)
        env[ELASTIC_STORE_ENV] = f"{self.master_addr}:{store_port}"
        env.setdefault(FULL_WORLD_ENV, str(self.world_size))

    def worker_env(
        self, local_rank: int, master_port: int, restart_count: int, base_env: dict[str, str],
        store_port: int | None = None, restarts_used: int | None = None,
    ) -> dict[str, str]:
        """The environment contract of one worker (DESIGN section 2), torchrun's names included.
        ``restart_count``: the attempt (``LOCKSTEP_RESTART_COUNT``); ``restarts_used``: the restarts
        of ``--max_restarts`` used before it (``TORCHELASTIC_RESTART_COUNT``, which, as torchrun's
        agent counts, a restart to let a node in leaves unchanged), the attempt when None.
        ``store_port``: the port of the store the launcher hosts, where an elastic job's membership
        is, when the ranks rendezvous in another (a restart's on one node)."""
        rank = self.base_rank + local_rank
        env = dict(base_env)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(self.nproc),
            NODE_RANK=str(self.node_rank),
            BASE_RANK=str(self.base_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(master_port),
            # torchrun's names, so scripts and libraries written for torchrun run unchanged.
            GROUP_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.group_world_size),
            ROLE_NAME=self.role,
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(self.world_size),
            TORCHELASTIC_RUN_ID=self.run_id or self.run_directory.name,
            TORCHELASTIC_RESTART_COUNT=str(restart_count if restarts_used is None else restarts_used),
            TORCHELASTIC_MAX_RESTARTS=str(self.max_restarts),
            TORCHELASTIC_ERROR_FILE=str(self.error_file(rank, restart_count)),
            TORCHELASTIC_SIGNALS_TO_HANDLE=SIGNALS_TO_HANDLE,
            # Every rank connects to the store the launcher's node hosts, instead of rank 0
            # binding MASTER_PORT itself (which races with anything else that grabs the port).
            TORCHELASTIC_USE_AGENT_STORE="True",
            LOCKSTEP_RESTART_COUNT=str(restart_count),
            LOCKSTEP_RUN_DIRECTORY=str(self.run_directory),
            PYTHONUNBUFFERED="1",
        )
        if self.min_ranks:
            self._elastic_env(env, restart_count, store_port or self.master_port or master_port)
        if self.verbose:  # configuration errors with their tracebacks (lockstep.errors)
            env["LOCKSTEP_VERBOSE"] = "1"
        # As torchrun's agent: a failed NCCL collective raises instead of hanging until the timeout.
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        self._thread_shares(env, base_env)
        return env

    def _thread_shares(self, env: dict[str, str], base_env: dict[str, str]) -> None:
        """Each rank's share of the node's cores for torch's threads and torch.compile's kernel
        compiler, where the user set none: the compiler starts min(32, cores) worker processes in
        every rank (8 ranks on 32 cores: 256, each holding its own copy of torch); at 1, none."""
        share = str(max(1, (os.cpu_count() or 1) // self.nproc))
        for name in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
            if name not in base_env:
                env[name] = share
