"""torchrun's command line, accepted by ``lockstep``: its flags as aliases, the rest refused.

A torchrun flag either means something lockstep does (``--nproc-per-node`` is ``-n``,
``--rdzv-endpoint HOST:PORT`` is ``--master_addr HOST --master_port PORT``), is accepted because it
changes nothing for a script (``--start-method``, ``--monitor-interval``), or is a usage error whose
one line names the lockstep way. Pure parsing, like the rest of cli.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence

from lockstep.launcher.plan import LaunchError, Stream

NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
RDZV_BACKENDS = ("c10d", "static")
_DEFAULT_RDZV_PORT = 29400  # torchrun's port for an endpoint given without one
ENDPOINT_FORMS = "HOST, HOST:PORT or [IPv6]:PORT"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HOST = re.compile(r"[\w.-]+")
"""Host names and IPv4 addresses: the characters torch's own check of an endpoint's host allows, less ':'."""
_RANK_ENV = ("WORLD_SIZE", "NODE_RANK", "BASE_RANK", "MASTER_ADDR", "MASTER_PORT")
_STREAM_MAP = re.compile(r"(\d+:[0-3],)*\d+:[0-3]")

_REFUSED: dict[tuple[str, ...], tuple[int, str]] = {
    ("--run-path", "--run_path"): (
        0, "lockstep starts every rank in a fresh interpreter; drop --run-path"),
    ("--local-addr", "--local_addr"): (
        1, "ranks reach the master at --master_addr, so --local-addr is not used; drop it"),
    ("--logs-specs", "--logs_specs"): (
        1, "custom LogsSpecs are not supported; name the log files with --stdout/--stderr and --run_directory"),
    ("--duplicate-stdout-filters", "--duplicate_stdout_filters"): (
        1, "duplicate filters are not supported; search the rank logs under --run_directory instead"),
    ("--duplicate-stderr-filters", "--duplicate_stderr_filters"): (
        1, "duplicate filters are not supported; search the rank logs under --run_directory instead"),
    ("--numa-binding", "--numa_binding"): (
        1, "NUMA binding is not supported; bind in the script (os.sched_setaffinity by LOCAL_RANK)"),
    ("--signals-to-handle", "--signals_to_handle"): (
        1, "lockstep forwards SIGINT and SIGTERM to every rank and does not take another list; drop it"),
    ("--virtual-local-rank", "--virtual_local_rank"): (
        0, "not supported; select the device from LOCAL_RANK in the script"),
}


class _Refuse(argparse.Action):
    """A torchrun flag lockstep cannot honour: a usage error as soon as it is seen."""

    def __init__(self, option_strings: Sequence[str], dest: str, message: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise LaunchError(f"{option_string}: {self.message}")


def nproc_value(text: str) -> int | str:
    """torchrun's --nproc-per-node: a positive integer or one of NPROC_WORDS."""
    if text in NPROC_WORDS:
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer or one of {', '.join(NPROC_WORDS)}, got {text!r}")


def stream_value(text: str) -> Stream | dict[int, Stream]:
    """torchrun's --tee / --redirects: 0 none, 1 stdout, 2 stderr, 3 both, or a value per local
    rank such as ``0:3,1:1`` (local ranks it does not name: 0)."""
    if text in ("0", "1", "2", "3"):
        return Stream(int(text))
    if _STREAM_MAP.fullmatch(text):
        pairs = [item.split(":") for item in text.split(",")]
        return {int(rank): Stream(int(value)) for rank, value in pairs}
    raise argparse.ArgumentTypeError(
        f"expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or one per local rank like 0:3,1:1, got {text!r}")


def check_stream_map(flag: str, value: Stream | Mapping[int, Stream], nproc: int) -> None:
    """A per-rank --tee / --redirects map names local ranks of this node only."""
    if not isinstance(value, Stream) and any(not 0 <= r < nproc for r in value):
        raise LaunchError(f"{flag} {','.join(f'{r}:{int(v)}' for r, v in value.items())}: "
                          f"local ranks are 0..{nproc - 1}")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser, mode: argparse._MutuallyExclusiveGroup, types) -> None:
    """torchrun's flags; ``types`` holds lockstep's own argparse types by flag dest."""
    group = parser.add_argument_group("torchrun's flags, accepted as aliases (see the README)")

    def alias(*names: str, dest: str, **kwargs) -> None:
        (mode if dest in ("module_mode", "command_mode") else group).add_argument(
            *names, dest=dest, default=argparse.SUPPRESS, **kwargs)

    alias("--nproc-per-node", "--nproc_per_node", dest="nproc", type=nproc_value,
          help="= -n; also auto (CUDA devices, else CPU cores), cpu (CPU cores), gpu (CUDA devices)")
    alias("--nnodes", dest="nnodes", help="nodes: N or N:N (world_size = nnodes x nproc)")
    alias("--node-rank", dest="node_rank", type=types["node_rank"], help="= --node_rank")
    alias("--master-addr", dest="master_addr", help="= --master_addr")
    alias("--master-port", dest="master_port", type=types["master_port"], help="= --master_port")
    alias("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
          help="HOST, HOST:PORT or [IPv6]:PORT (tcp:// in front is accepted) = --master_addr HOST "
               "--master_port PORT (default port 29400; one node: port 0 picks a free one)")
    alias("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
          help="c10d or static: either is lockstep's static store on the master; give --node-rank on each node")
    alias("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="TORCHELASTIC_RUN_ID (default: the run directory's name)")
    alias("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf",
          help="join_timeout=SECONDS = --rdzv_timeout, last_call_timeout=SECONDS = --rdzv_last_call")
    alias("--standalone", dest="standalone", action="store_true", help="one node, the launcher picks the port")
    alias("--max-restarts", dest="max_restarts", type=types["max_restarts"], help="= --max_restarts")
    alias("--shutdown-timeout", "--shutdown_timeout", dest="grace_period", type=types["grace_period"],
          help="= --grace_period")
    alias("--log-dir", "--log_dir", dest="log_dir",
          help="= --run_directory, which also keeps torchrun's layout of the ranks' files: "
               "LOG_DIR/<run_id>_<x>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}")
    alias("--module", dest="module_mode", action="store_true", help="torchrun's name for -m")
    alias("--no-python", "--no_python", dest="command_mode", action="store_true", help="torchrun's name for -c")
    alias("-r", "--redirects", dest="redirects", type=stream_value,
          help="0-3: local rank 0's stdout (1), stderr (2) or both (3) go to its log files only "
               "(or per local rank: 0:3,1:0)")
    alias("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter",
          help="with --tee: the local ranks (e.g. 0,1) whose lines are shown")
    alias("--role", dest="role", help="ROLE_NAME of every rank (default: default)")
    alias("--monitor-interval", "--monitor_interval", dest="monitor_interval", type=_non_negative_seconds,
          help="accepted and ignored: lockstep sees a rank exit at once")
    alias("--start-method", "--start_method", dest="start_method", choices=("spawn", "fork", "forkserver"),
          help="accepted and ignored: every rank is a fresh process")
    alias("--event-log-handler", "--event_log_handler", dest="event_log_handler",
          help="only null (torchrun's default)")
    for names, (nargs, message) in _REFUSED.items():
        parser.add_argument(*names, action=_Refuse, nargs=nargs, message=message)


def pet_arguments(parser: argparse.ArgumentParser, given: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """torchrun's ``PET_<FLAG>`` variables (``PET_NPROC_PER_NODE=2``, ``PET_NNODES``, ...) as the
    flags they stand for, for each flag the command line did not set: flags win, as in torchrun."""
    extra: list[str] = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        dashed = [o for o in action.option_strings if o.startswith("--") and ("-" in o[2:] or o[2:].isalpha())]
        if not dashed:
            continue
        value = next((env[n] for n in (_pet_name(o) for o in dashed) if env.get(n)), None)
        if value is None or getattr(given, action.dest, None) not in (None, False):
            continue
        if action.nargs == 0:  # a switch: torchrun reads 1/0
            if value.strip().lower() in ("1", "true", "yes"):
                extra.append(dashed[0])
        else:
            extra += [dashed[0], value]
    return extra


def _pet_name(option: str) -> str:
    return "PET_" + option[2:].replace("-", "_").upper()


def resolve_nproc(value: int | str, cuda_devices: int) -> int:
    """A number for torchrun's words, counted as torchrun counts them."""
    if isinstance(value, int):
        return value
    if value == "xpu":
        raise LaunchError("--nproc-per-node xpu: lockstep counts CUDA devices only; pass a number")
    if value == "gpu" and cuda_devices == 0:
        raise LaunchError("--nproc-per-node gpu: no CUDA device is visible; pass a number or cpu")
    if value == "cpu" or (value == "auto" and cuda_devices == 0):
        return os.cpu_count() or 1
    return cuda_devices


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's --nnodes N or MIN:MAX, as (MIN, MAX). lockstep starts the job on MAX nodes (on
    MIN or more once the last call passed); with MIN < MAX it goes on while MIN nodes' ranks live
    (an elastic job)."""
    low, _, high = text.partition(":")
    try:
        low_n, high_n = int(low), int(high or low)
    except ValueError:
        raise LaunchError(f"--nnodes: expected N or MIN:MAX, got {text!r}") from None
    if low_n < 1 or high_n < 1:
        raise LaunchError(f"--nnodes: expected a positive number of nodes, got {text!r}")
    if low_n > high_n:
        raise LaunchError(f"--nnodes {text}: MIN is more than MAX: give MIN:MAX with MIN <= MAX")
    return low_n, high_n


def parse_endpoint(text: str, source: str = "--rdzv-endpoint") -> tuple[str, int]:
    """HOST, HOST:PORT, [IPv6] or [IPv6]:PORT of --rdzv-endpoint (``source`` names where it came
    from), with torchrun's port 29400 where none is given; port 0: any free port. A ``tcp://`` in
    front is dropped: users copy it from ``init_method`` URLs. Anything else is a usage error, not a
    host name to wait for."""
    endpoint = text.strip()
    scheme = _SCHEME.match(endpoint)
    if scheme:
        if scheme[1].lower() != "tcp":
            raise _bad_endpoint(text, source, f"only tcp:// may come before the host, not {scheme[0]}")
        endpoint = endpoint[scheme.end():]
    if endpoint.startswith("["):
        host, closed, rest = endpoint[1:].partition("]")
        if not closed or not is_ipv6(host) or (rest and not rest.startswith(":")):
            raise _bad_endpoint(text, source, "brackets hold an IPv6 address, with :PORT after them")
        return host, _endpoint_port(text, source, rest[1:]) if rest else _DEFAULT_RDZV_PORT
    if endpoint.count(":") > 1:
        head, _, port = endpoint.rpartition(":")
        hint = f"[{endpoint}]:PORT" if is_ipv6(endpoint) else f"[{head}]:{port}" if is_ipv6(head) else None
        raise _bad_endpoint(text, source, f"an IPv6 address goes in brackets, {hint}" if hint else "too many ':'")
    host, colon, port = endpoint.partition(":")
    if not _HOST.fullmatch(host):
        raise _bad_endpoint(text, source, f"{host!r} is not a host name or an IPv4 address" if host else "no host")
    return host, _endpoint_port(text, source, port) if colon else _DEFAULT_RDZV_PORT


def is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def is_host(text: str) -> bool:
    """A host name (labels of letters, digits, '-' and '_'), an IPv4 address, or an IPv6 one."""
    return bool(_HOST.fullmatch(text)) or is_ipv6(text)


def _bad_endpoint(text: str, source: str, why: str) -> LaunchError:
    return LaunchError(f"{source} {text!r}: {why}; expected {ENDPOINT_FORMS}, e.g. 10.0.0.1:29400 or "
                       f"[fd00::1]:29400 (tcp:// in front is accepted)")


def _endpoint_port(text: str, source: str, port: str) -> int:
    if port.isdigit() and 0 <= int(port) <= 65535:
        return int(port)
    raise _bad_endpoint(text, source, "the port must be a number 0-65535")


_RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout")


def parse_rdzv_conf(text: str) -> dict[str, float]:
    """The seconds of --rdzv-conf key=value pairs, by key: ``join_timeout`` (--rdzv_timeout) and
    ``last_call_timeout`` (--rdzv_last_call); other keys are refused."""
    conf = {}
    for pair in filter(None, text.split(",")):
        key, _, value = (part.strip() for part in pair.partition("="))
        if key not in _RDZV_CONF_KEYS:
            raise LaunchError(
                f"--rdzv-conf {key!r} is not supported; only join_timeout=SECONDS (the same as --rdzv_timeout) "
                f"and last_call_timeout=SECONDS (--rdzv_last_call)")
        try:
            conf[key] = _positive_seconds(value)
        except argparse.ArgumentTypeError as e:
            raise LaunchError(f"--rdzv-conf {key}: {e}") from None
    return conf


def check_accepted(args: argparse.Namespace) -> None:
    """Usage errors for torchrun values lockstep cannot honour."""
    backend = getattr(args, "rdzv_backend", None)
    if backend is not None and backend not in RDZV_BACKENDS:
        raise LaunchError(
            f"--rdzv-backend {backend}: not supported; lockstep's rendezvous is a c10d store on the "
            f"master: use --rdzv-backend c10d or --master_addr/--master_port")
    handler = getattr(args, "event_log_handler", None)
    if handler not in (None, "null"):
        raise LaunchError(f"--event-log-handler {handler}: not supported; only null")
    if getattr(args, "local_ranks_filter", None) is not None and not getattr(args, "tee", None):
        raise LaunchError("--local-ranks-filter picks the ranks --tee shows: add --tee 3 "
                          "(without --tee only local rank 0 reaches the console)")


def missing_node_rank(args: argparse.Namespace, nnodes: int) -> LaunchError:
    """The usage error for a multi-node torchrun line without a node rank, which torchrun's c10d
    rendezvous would have assigned."""
    endpoint = getattr(args, "rdzv_endpoint", None)
    where = f"{parse_endpoint(endpoint)[0]}, the host of --rdzv-endpoint" if endpoint else "the --master-addr host"
    others = "1 on the other node" if nnodes == 2 else f"1..{nnodes - 1} on the others, one each"
    backend = getattr(args, "rdzv_backend", None)
    head = f"--rdzv-backend {backend}" if backend else f"a {nnodes}-node run"
    return LaunchError(
        f"{head} needs --node-rank on each node: lockstep's rendezvous is static and does not number "
        f"the nodes as torchrun's c10d backend does; pass --node-rank R (0 on {where}; {others})")


def parse_local_ranks(text: str | None, nproc: int) -> frozenset[int] | None:
    """--local-ranks-filter 0,2 -> {0, 2}."""
    if text is None:
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise LaunchError(f"--local-ranks-filter: expected local ranks like 0,1, got {text!r}") from None
    if not ranks or any(not 0 <= r < nproc for r in ranks):
        raise LaunchError(f"--local-ranks-filter {text}: local ranks are 0..{nproc - 1}")
    return ranks


def standalone_env(env: Mapping[str, str]) -> dict[str, str]:
    """--standalone is one node on its own: rank variables in the launcher's env (SLURM's too) do not apply."""
    return {k: v for k, v in env.items() if k not in _RANK_ENV and not k.startswith("SLURM_")}
