"""``lockstep`` command line: argv + env -> LaunchPlan. Pure: no processes, no sockets, no torch (only SLURM's
master host name goes through the system resolver)."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import secrets
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from lockstep import __version__
from lockstep.launcher import inputs, limits, slurm, torchrun
from lockstep.launcher.plan import (
    DEFAULT_LINE_PREFIX,
    DEFAULT_RDZV_LAST_CALL,
    DEFAULT_RDZV_TIMEOUT,
    FORMAT_FIELDS,
    LaunchError,
    LaunchPlan,
    Mode,
    Stream,
)

_DESCRIPTION = """\
Start NPROC copies of a training script on this node, each with the torch.distributed environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT) set. Flags
override the environment variables named in their help. If any rank fails, the others are stopped
and the launcher exits with the failed rank's exit code."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, no usage dump: the message says what to change.
        if message.startswith("the following arguments are required"):
            message = "no training script given: lockstep [-n NPROC] [options] script.py [args ...]"
        raise LaunchError(message)


def _number(kind: type, low: float, high: float | None, expected: str, low_inclusive: bool = True):
    """An argparse type: parse as ``kind``, finite, and require low <= value (<= high)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (value is None or not math.isfinite(value) or value < low or (value == low and not low_inclusive)
                or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, 1, None, "a positive integer")
_non_negative_int = _number(int, 0, None, "an integer >= 0")
_port = _number(int, 1, 65535, "a port number 1-65535")
# Bounded so that a typo (inf, 1e308) cannot make a teardown or a wait last forever.
_grace_seconds = _number(float, 0.0, 86400.0, "seconds > 0 and at most 86400", low_inclusive=False)
_rdzv_seconds = _number(float, 0.0, 604800.0, "seconds > 0 and at most 604800", low_inclusive=False)
_stall_seconds = _number(float, 0.0, 604800.0, "seconds >= 0 and at most 604800 (0: off)")


def build_parser() -> argparse.ArgumentParser:
    """lockstep's flags, then torchrun's names for them (torchrun.py)."""
    fields = ", ".join("{%s}" % f for f in FORMAT_FIELDS)

    def fmt_help(stream: str) -> str:
        return (f"Format string for the file that receives the {stream.upper()} of every rank but "
                f"local rank 0 (which goes to the console). Fields: {fields}. Default: "
                f"RUN_DIRECTORY/rank{{rank}}.{stream}.log, kept after the run.")

    p = _Parser(prog="lockstep", description=_DESCRIPTION, allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"lockstep {__version__}")
    p.add_argument("-n", "--nproc", type=_positive_int, default=None,
                   help="Processes to start on this node. Default: env LOCAL_WORLD_SIZE, else the "
                        "number of visible CUDA devices, at least 1.")
    p.add_argument("--stdout", default=None, help=fmt_help("stdout"))
    p.add_argument("--stderr", default=None, help=fmt_help("stderr"))
    p.add_argument("-v", "--verbose", action="store_true", help="Print what the launcher does, and the ranks' tracebacks of configuration errors.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-m", "--module_mode", action="store_true",
                      help="Run training_script as a module (python -m).")
    mode.add_argument("-c", "--command_mode", action="store_true",
                      help="Run training_script as a command, without python.")
    p.add_argument("--run_directory", default=None,
                   help="Folder for run artifacts and rank logs. Default: runs/<timestamp>.")
    _add_failure_arguments(p)
    p.add_argument("-t", "--tee", type=torchrun.stream_value, default=Stream.NONE,
                   help="Also show every rank's stdout (1), stderr (2) or both (3) on the console, "
                        "each line prefixed [default<local rank>]: as under torchrun (env "
                        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE changes it), while its log files are still "
                        "written; or one value per local rank, e.g. 0:3,1:1. Default: 0.")
    p.add_argument("training_script", help="Script (or module with -m, command with -c) to run.")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER,
                   help="Arguments passed on to the training script.")
    _add_multinode_arguments(p)
    torchrun.add_arguments(p, mode, {"node_rank": _non_negative_int, "master_port": _port,
                                     "max_restarts": _non_negative_int, "grace_period": _grace_seconds})
    return p


def _add_failure_arguments(p: argparse.ArgumentParser) -> None:
    """What the launcher does when a rank fails, is lost, or stalls."""
    p.add_argument("--max_restarts", type=_non_negative_int, default=None,
                   help="When a rank fails, stop every rank and restart them all (on several nodes, "
                        "every node's together) up to this many times (env LOCKSTEP_MAX_RESTARTS). "
                        "Default: 0.")
    p.add_argument("--min_ranks", type=_positive_int, default=None,
                   help="Elastic training: when a rank or a node is lost (a rank exits with an error or is "
                        "killed; a node's launcher stops answering) and at least this many ranks live, they "
                        "go on at the smaller world size from the step in flight, training the same global "
                        "batches (a Trainer under DDP). torchrun's --nnodes MIN:MAX sets it to MIN nodes' "
                        "ranks. Default: off, a lost rank stops the job.")
    p.add_argument("--rank_restarts", type=_non_negative_int, default=0,
                   help="With --min_ranks (or --nnodes MIN:MAX): start a lost rank again in place, on its "
                        "node, up to this many times per rank; it joins the running job at a step boundary "
                        "and takes the state from its peers, and the world grows back. Default: 0 (a lost "
                        "rank stays lost).")
    p.add_argument("--grace_period", type=_grace_seconds, default=5.0,
                   help="Seconds ranks get to exit after SIGTERM before SIGKILL. Default: 5.")
    p.add_argument("--stall_timeout", type=_stall_seconds, default=None,
                   help="End the job (exit code 124) when a rank that reports progress (the Trainer "
                        "does, each batch; a script with lockstep.dist.heartbeat()) has made none for "
                        "this many seconds, after printing every rank's stack and which ranks stopped "
                        "first (env LOCKSTEP_STALL_TIMEOUT). Default: 0, off.")


def _add_multinode_arguments(p: argparse.ArgumentParser) -> None:
    multi = p.add_argument_group("multi-node arguments (needed when world_size > nproc)")
    multi.add_argument("--world_size", type=_positive_int, default=None,
                       help="Processes over all nodes (env WORLD_SIZE). Default: nproc.")
    multi.add_argument("--base_rank", type=_non_negative_int, default=None,
                       help="Global rank of this node's first process (env BASE_RANK).")
    multi.add_argument("--node_rank", type=_non_negative_int, default=None,
                       help="Rank of this node (env NODE_RANK). With only one of base_rank and "
                            "node_rank, nodes are assumed equal: base_rank = node_rank * nproc.")
    multi.add_argument("--master_addr", default=None,
                       help="Address of the node that runs rank 0 (env MASTER_ADDR). "
                            "Default on one node: 127.0.0.1.")
    multi.add_argument("--master_port", type=_port, default=None,
                       help="Port of the c10d store on the master (env MASTER_PORT). Default on "
                            "one node: a free port the launcher holds.")
    multi.add_argument("--rdzv_timeout", "--rdzv-timeout", type=_rdzv_seconds, default=None,
                       help="Seconds a node without rank 0 waits for the master's store before it "
                            f"gives up (env LOCKSTEP_RDZV_TIMEOUT). Default: {DEFAULT_RDZV_TIMEOUT:g}.")
    multi.add_argument("--rdzv_last_call", "--rdzv-last-call", type=_rdzv_seconds, default=None,
                       help="An elastic job (--nnodes MIN:MAX): once MIN nodes joined, seconds the master "
                            "waits for the others before it starts without them (they join the running job "
                            f"when they start). Default: {DEFAULT_RDZV_LAST_CALL:g}, as torchrun's "
                            "last_call_timeout.")


def _from_env(env: Mapping[str, str], name: str, parse, flag: str):
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise LaunchError(f"env {name}: {e} (or pass {flag})") from None


def _visible_cuda_devices(env: Mapping[str, str]) -> int:
    # Counted without importing torch, which would cost the launcher a second or more.
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def _resolve_ranks(nproc: int, world_size: int, base_rank: int | None, node_rank: int | None) -> tuple[int, int]:
    if world_size < nproc:
        raise LaunchError(f"world_size {world_size} is smaller than nproc {nproc}: raise --world_size or lower -n")
    if world_size == nproc:
        if (base_rank or 0) != 0 or (node_rank or 0) != 0:
            raise LaunchError(
                f"world_size {world_size} == nproc {nproc} is a single-node run, so base_rank and "
                f"node_rank must be 0; for multi-node set --world_size to the total over all nodes")
        return 0, 0
    if base_rank is None and node_rank is None:
        raise LaunchError(
            f"multi-node run (world_size {world_size} > nproc {nproc}) needs --node_rank or --base_rank")
    if base_rank is None:
        base_rank = node_rank * nproc
    elif node_rank is None:
        if base_rank % nproc:
            raise LaunchError(
                f"base_rank {base_rank} is not a multiple of nproc {nproc}, so node_rank cannot be "
                f"inferred: pass --node_rank too")
        node_rank = base_rank // nproc
    if base_rank + nproc > world_size:
        raise LaunchError(
            f"this node's ranks {base_rank}..{base_rank + nproc - 1} do not fit in world_size "
            f"{world_size}: check --world_size, -n, --node_rank and --base_rank")
    return base_rank, node_rank


def _nproc(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    cuda_devices = _visible_cuda_devices(env)
    if args.nproc is not None:
        return torchrun.resolve_nproc(args.nproc, cuda_devices)
    return _from_env(env, "LOCAL_WORLD_SIZE", _positive_int, "-n") or max(1, cuda_devices)


def _world(args: argparse.Namespace, env: Mapping[str, str], nproc: int, notes: list[str]) -> tuple[int, int | None]:
    """(world_size, nnodes); torchrun's --nnodes N means world_size = N x nproc; else SLURM's nodes."""
    text = getattr(args, "nnodes", None)
    nnodes = torchrun.parse_nnodes(text)[1] if text is not None else None
    if nnodes is None:
        world_size = args.world_size or _from_env(env, "WORLD_SIZE", _positive_int, "--world_size")
        if world_size is None and (step := slurm.step(env)) is not None:
            notes.append(f"SLURM: {step.nnodes} node(s) x {nproc} ranks")
            return step.nnodes * nproc, step.nnodes
        return world_size or nproc, None
    if args.world_size is not None and args.world_size != nnodes * nproc:
        raise LaunchError(f"--world_size {args.world_size} is not --nnodes {nnodes} x nproc {nproc}: "
                          f"pass only one of them")
    return nnodes * nproc, nnodes


def _node(args: argparse.Namespace, env: Mapping[str, str], nproc: int, world_size: int,
          notes: list[str]) -> tuple[int, int]:
    """(base_rank, node_rank) from flags, else env, checked against the world."""
    base_rank = args.base_rank
    if base_rank is None:
        base_rank = _from_env(env, "BASE_RANK", _non_negative_int, "--base_rank")
    node_rank = args.node_rank
    if node_rank is None:
        node_rank = _from_env(env, "NODE_RANK", _non_negative_int, "--node_rank")
    if base_rank is None and node_rank is None and world_size > nproc and (step := slurm.step(env)) is not None:
        node_rank = step.node_rank
        notes.append(f"SLURM: this is node {node_rank} (SLURM_NODEID)")
        if (node_rank + 1) * nproc > world_size:
            raise LaunchError(f"env SLURM_NODEID is {node_rank}, but the job has {math.ceil(world_size / nproc)} "
                              f"node(s) (world_size {world_size}, -n {nproc}): run lockstep under srun on the "
                              f"step's nodes, or pass --node_rank")
    if base_rank is None and node_rank is None and world_size > nproc and _torchrun_style(args):
        raise torchrun.missing_node_rank(args, math.ceil(world_size / nproc))
    return _resolve_ranks(nproc, world_size, base_rank, node_rank)


def _torchrun_style(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in ("nnodes", "rdzv_backend", "rdzv_endpoint"))


def _master(args: argparse.Namespace, env: Mapping[str, str], multinode: bool,
            notes: list[str], pet: list[str]) -> tuple[str | None, int | None]:
    addr, port = args.master_addr, args.master_port
    endpoint = getattr(args, "rdzv_endpoint", None)
    free_port = False  # --rdzv-endpoint HOST:0, which no variable overrides
    if endpoint is not None:
        host, endpoint_port = torchrun.parse_endpoint(endpoint)
        if addr not in (None, host) or port not in (None, endpoint_port or None):
            raise LaunchError(f"--rdzv-endpoint {endpoint} disagrees with --master_addr/--master_port: "
                              f"pass only one of them")
        if endpoint_port == 0 and multinode:
            raise LaunchError(f"--rdzv-endpoint {endpoint}: port 0 picks a free port, which works on one node "
                              f"only; give every node the same port, e.g. {host}:29400")
        addr, port, free_port = host, endpoint_port or None, endpoint_port == 0
    addr = addr or env.get("MASTER_ADDR") or None
    if not free_port:
        port = port or _from_env(env, "MASTER_PORT", _port, "--master_port")
    if multinode and (step := slurm.step(env)) is not None:
        if addr is None:
            addr = slurm.resolve(step.master_host, f"the first host of {step.hostlist_name}")
            notes.append(f"SLURM: master {step.master_host} ({addr}), the first host of {step.hostlist_name}")
        if port is None:
            port = step.master_port
            notes.append(f"SLURM: master port {port}, from SLURM_JOB_ID")
    if addr is not None and not torchrun.is_host(addr):
        source = "env PET_MASTER_ADDR" if "--master-addr" in pet else \
            "--master_addr" if args.master_addr is not None else "env MASTER_ADDR"
        raise LaunchError(f"{source} {addr!r} is not a host name or an IP address"
                          f"{' (write an IPv6 address without brackets)' if addr.startswith('[') else ''}; "
                          f"for HOST:PORT use --rdzv-endpoint")
    if multinode and addr is None:
        raise LaunchError("multi-node run needs --master_addr (or env MASTER_ADDR): the address of the node with rank 0")
    if multinode and port is None:
        raise LaunchError("multi-node run needs --master_port (or env MASTER_PORT): a port open on the node with rank 0")
    return addr, port


def _standalone(args: argparse.Namespace, nproc: int, world_size: int) -> None:
    if world_size > nproc or (args.node_rank or 0) or (args.base_rank or 0):
        raise LaunchError(f"--standalone runs one node, but world_size {world_size} > nproc {nproc} or a "
                          f"node/base rank was given: drop --standalone for a multi-node run")
    # As torchrun does, --standalone picks the store's port itself, on localhost; and without
    # --rdzv-id, a fresh run id.
    args.master_addr, args.master_port, args.rdzv_endpoint = "localhost", None, None
    if getattr(args, "rdzv_id", None) is None:
        args.rdzv_id = str(uuid.uuid4())


def _run_directory(args: argparse.Namespace, stamp: str) -> tuple[Path, Path | None]:
    """The run directory, and torchrun's --log-dir when given (the same folder)."""
    log_dir = getattr(args, "log_dir", None)
    if log_dir is not None and args.run_directory is not None and Path(log_dir) != Path(args.run_directory):
        raise LaunchError(f"--log-dir {log_dir} and --run_directory {args.run_directory} name two folders: "
                          f"pass only one of them")
    folder = args.run_directory or log_dir
    return Path(folder or Path("runs") / stamp), Path(log_dir) if log_dir is not None else None


def _token() -> str:
    """8 random characters, as those of the folder torchrun makes for a run's logs (mkdtemp's)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789_"
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _rdzv_times(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[float, float]:
    """(--rdzv_timeout, --rdzv_last_call): the flags, else torchrun's --rdzv-conf keys, else the defaults."""
    conf = getattr(args, "rdzv_conf", None)
    given = torchrun.parse_rdzv_conf(conf) if conf else {}
    timeout = args.rdzv_timeout or given.get("join_timeout") \
        or _from_env(env, "LOCKSTEP_RDZV_TIMEOUT", _rdzv_seconds, "--rdzv_timeout") or DEFAULT_RDZV_TIMEOUT
    return timeout, args.rdzv_last_call or given.get("last_call_timeout") or DEFAULT_RDZV_LAST_CALL


def _stall_timeout(args: argparse.Namespace, env: Mapping[str, str]) -> float:
    if args.stall_timeout is not None:
        return args.stall_timeout
    return _from_env(env, "LOCKSTEP_STALL_TIMEOUT", _stall_seconds, "--stall_timeout") or 0.0


def _check_values(args: argparse.Namespace, pet: list[str]) -> None:
    """Values no later step would refuse in time: an endpoint that is not one would be waited for
    as a host name, an empty folder would silently become the default one."""
    endpoint = getattr(args, "rdzv_endpoint", None)
    if endpoint is not None:
        torchrun.parse_endpoint(endpoint, "env PET_RDZV_ENDPOINT" if "--rdzv-endpoint" in pet else "--rdzv-endpoint")
    for flag, value in (("--log-dir", getattr(args, "log_dir", None)), ("--run_directory", args.run_directory),
                        ("--stdout", args.stdout), ("--stderr", args.stderr)):
        if value is not None and not value.strip():
            raise LaunchError(f"{flag} {value!r}: expected a path; leave the flag out for the default")


def _parsed(argv: Sequence[str], env: Mapping[str, str]) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[str]]:
    """The parser, the arguments (torchrun's ``PET_*`` variables read as flags, the command line
    winning) and those variables' flags; each value checked."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    pet = torchrun.pet_arguments(parser, args, env)
    if pet:
        args = parser.parse_args([*pet, *argv])
    if args.training_script.startswith("-"):
        raise LaunchError(f"unknown option {args.training_script!r} (see lockstep --help)")
    torchrun.check_accepted(args)
    _check_values(args, pet)
    return parser, args, pet


def _checked_outputs(args: argparse.Namespace, nproc: int) -> Mode:
    """Check the output flags and the target; what the target is."""
    inputs.check_format("stdout", args.stdout)
    inputs.check_format("stderr", args.stderr)
    mode = Mode.MODULE if args.module_mode else Mode.COMMAND if args.command_mode else Mode.SCRIPT
    inputs.check_target(mode, args.training_script)
    torchrun.check_stream_map("--tee", args.tee, nproc)
    torchrun.check_stream_map("--redirects", getattr(args, "redirects", Stream.NONE), nproc)
    return mode


def parse_plan(argv: Sequence[str], env: Mapping[str, str], now: datetime.datetime | None = None) -> LaunchPlan:
    """Turn the command line and environment into a LaunchPlan; raise LaunchError on bad input."""
    parser, args, pet = _parsed(argv, env)
    standalone = getattr(args, "standalone", False)
    if standalone:
        env = torchrun.standalone_env(env)
    nproc = _nproc(args, env)
    notes: list[str] = []
    world_size, nnodes = _world(args, env, nproc, notes)
    if standalone:
        _standalone(args, nproc, world_size)
    base_rank, node_rank = _node(args, env, nproc, world_size, notes)
    master_addr, master_port = _master(args, env, world_size > nproc, notes, pet)
    max_restarts = args.max_restarts
    if max_restarts is None:
        max_restarts = _from_env(env, "LOCKSTEP_MAX_RESTARTS", _non_negative_int, "--max_restarts") or 0
    mode = _checked_outputs(args, nproc)
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%dT%H-%M-%S-%f")
    run_directory, torchrun_logs = _run_directory(args, stamp)
    run_id = getattr(args, "rdzv_id", None)
    tee, redirects = args.tee, getattr(args, "redirects", Stream.NONE)
    rdzv_timeout, rdzv_last_call = _rdzv_times(args, env)
    plan = LaunchPlan(
        nproc=nproc, world_size=world_size, base_rank=base_rank, node_rank=node_rank,
        master_addr=master_addr or "127.0.0.1", master_port=master_port,
        run_directory=run_directory,
        stdout_format=args.stdout, stderr_format=args.stderr,
        mode=mode, target=args.training_script, target_args=tuple(args.training_script_args),
        verbose=args.verbose, max_restarts=max_restarts, grace_period=args.grace_period,
        rdzv_timeout=rdzv_timeout, rdzv_last_call=rdzv_last_call, tee=tee, redirects=redirects,
        tee_ranks=torchrun.parse_local_ranks(getattr(args, "local_ranks_filter", None), nproc),
        run_id=run_id, nnodes=nnodes, role=getattr(args, "role", "default"),
        line_prefix=env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or DEFAULT_LINE_PREFIX,
        torchrun_logs=torchrun_logs and torchrun_logs / f"{run_id or run_directory.name}_{_token()}",
        stall_timeout=_stall_timeout(args, env), notes=tuple(notes), min_ranks=_min_ranks(args, nproc),
        rank_restarts=getattr(args, "rank_restarts", 0),
        advice=_flags_after_the_script(parser, args.training_script, args.training_script_args),
    )
    _check_min_ranks(plan)
    limits.check_open_files(plan)  # first: the paths' check goes through every rank
    inputs.check_paths(plan)
    return plan


def _min_ranks(args: argparse.Namespace, nproc: int) -> int:
    """The ranks an elastic job goes on with: --min_ranks, or MIN nodes' of --nnodes MIN:MAX; 0: not elastic."""
    text = getattr(args, "nnodes", None)
    low, high = torchrun.parse_nnodes(text) if text is not None else (0, 0)
    if low == high:
        return args.min_ranks or 0
    if args.min_ranks:
        raise LaunchError(f"--nnodes {text} and --min_ranks {args.min_ranks} both set how few ranks the job goes on "
                          f"with: give one of them")
    return low * nproc


def _check_min_ranks(plan: LaunchPlan) -> None:
    if plan.rank_restarts and not plan.min_ranks:
        raise LaunchError(f"--rank_restarts {plan.rank_restarts} starts lost ranks again in a job that goes on "
                          f"without them: add --min_ranks (or --nnodes MIN:MAX), or use --max_restarts")
    if not plan.min_ranks:
        return
    if plan.min_ranks > plan.world_size:
        raise LaunchError(f"--min_ranks {plan.min_ranks} is more than the job's {plan.world_size} ranks: give at "
                          f"most {plan.world_size}")
    if plan.mode is Mode.COMMAND:
        raise LaunchError("--min_ranks needs ranks that run lockstep's Trainer (or lockstep.elastic): drop -c")


_SCRIPTS_OWN = {"-h", "--help", "-v", "--verbose", "--version", "-m", "--module"}
"""Flags a script is as likely to have as the launcher: no note for them."""


def _flags_after_the_script(parser: argparse.ArgumentParser, script: str,
                            script_args: Sequence[str]) -> tuple[str, ...]:
    """A note for the launcher's own flags among the script's arguments (``lockstep train.py -n 2``):
    everything after the script is the script's, so the launcher never sees them."""
    own = {flag for action in parser._actions for flag in action.option_strings} - _SCRIPTS_OWN
    found = " ".join(a for a in script_args if a.split("=", 1)[0] in own)
    if not found:
        return ()
    return (f"the launcher's flags after {script} ({found}) go to the script, not to the launcher: put them "
            f"before the script (lockstep {found} ... {script})",)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lockstep`` command; returns the process exit code."""
    try:
        plan = parse_plan(sys.argv[1:] if argv is None else argv, os.environ)
    except LaunchError as e:
        print(f"lockstep: error: {e}", file=sys.stderr)
        return 2
    for advice in plan.advice:
        print(f"lockstep: note: {advice}", file=sys.stderr, flush=True)
    if plan.verbose:
        for note in plan.notes:
            print(f"lockstep: {note}", file=sys.stderr, flush=True)
    from lockstep.launcher.supervisor import Supervisor

    return Supervisor(plan).run()
