"""The launcher's messages: exit descriptions and the report on the rank that failed first."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

from lockstep.launcher.job import LOST, SIGNALLED, STALLS, STOPPED, WAITING, Failure
from lockstep.launcher.output import console_streams, tail
from lockstep.launcher.plan import RankSpec, Stream

TAIL_LINES = 30
TRACEBACK_LINES = 200
"""A failed rank's output is shown from its last traceback when that starts this close to its end."""


def say(message: str) -> None:
    print(f"lockstep: {message}", file=sys.stderr, flush=True)


def describe_exit(code: int) -> str:
    """'exit code 3' or 'signal SIGSEGV' for a Popen returncode."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def shell_code(code: int) -> int:
    """The exit status a shell reports for a child's returncode (128 + N for signal N)."""
    return 128 - code if code < 0 else code


def configuration_error(path: Path) -> str | None:
    """The message of a configuration error a rank recorded in its error file (lockstep.errors),
    without its type; None for any other failure."""
    try:
        data = json.loads(path.read_text(errors="replace"))["message"]
        if data["extraInfo"].get("lockstep_configuration"):
            return str(data["message"]).partition(": ")[2] or str(data["message"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def read_error_file(path: Path) -> tuple[str, str] | None:
    """(message, traceback) from the file torch's ``@record`` writes, or None if there is none.

    ``record`` writes {"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack":
    traceback}}}; a plain string message is the newer format that some handlers write.
    """
    try:
        data = json.loads(path.read_text(errors="replace"))["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(data, str):
        return data, ""
    if not isinstance(data, dict):
        return None
    extra = data.get("extraInfo")
    trace = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
    return str(data.get("message", "")), str(trace)


def report_failure(spec: RankSpec, pid: int, code: int, others: list[tuple[int, int]]) -> bool:
    """Name the rank that failed first, then show its error and output; ``others``: (rank, code).
    A configuration error is its one line (``lockstep: error: ...``) alone; True then."""
    configuration = configuration_error(spec.error_file)
    if configuration is not None:
        say(f"error: {configuration}")
        return True
    say(f"rank {spec.rank} (local rank {spec.local_rank}, pid {pid}) failed first with {describe_exit(code)}")
    show_cause(spec)
    stopped = [f"{rank} ({describe_exit(c)})" for rank, c in others if c not in (0, None)]
    if stopped:
        say("other ranks ended: " + ", ".join(stopped))
    return False


def show_cause(spec: RankSpec) -> None:
    """Why the rank failed, as far as its output tells: its traceback (``@record``), where its
    output is, or its output's last lines."""
    error = read_error_file(spec.error_file)
    if error is not None:
        say(f"rank {spec.rank} raised {error[0]}")
    if console_streams(spec) & Stream.STDERR:
        also = f" (and in {spec.stderr_path})" if spec.stderr_path else ""
        say(f"rank {spec.rank}'s output is on the console above{also}")
    elif error is not None and error[1]:
        _show(f"traceback of rank {spec.rank} (from {spec.error_file}):", shown_part(error[1].splitlines(True)))
        say(f"rank {spec.rank}'s full output: {spec.stderr_path}"
            + (f" and {spec.stdout_path}" if spec.stdout_path not in (None, spec.stderr_path) else ""))
    else:
        _show_tail(spec)


def _output_tail(spec: RankSpec) -> tuple[Path | None, list[str]]:
    """What to show of the rank's stderr file, else of its stdout file (see :func:`shown_part`),
    and which file."""
    shown = spec.stderr_path
    lines = tail(shown, TRACEBACK_LINES) if shown else []
    if not lines and spec.stdout_path is not None:
        shown = spec.stdout_path
        lines = tail(shown, TRACEBACK_LINES)
    return shown, shown_part(lines)


_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_PREFIX = re.compile(r"^[ |]*(\[rank\d+\]: )*")
"""What comes before a line of a traceback: the report's ``  | `` and torch's ``[rankN]: ``."""


def _bare(line: str) -> str:
    return _PREFIX.sub("", line, count=1)


def shown_part(lines: list[str]) -> list[str]:
    """The part of a failed rank's last :data:`TRACEBACK_LINES` lines of output to show: its last
    traceback whole (with the ones chained to it) when it starts among them, else the last
    :data:`TAIL_LINES` lines."""
    starts = [i for i, line in enumerate(lines) if _bare(line).startswith("Traceback (most recent call last)")]
    if not starts:
        return lines[-TAIL_LINES:]
    first = starts.pop()
    while starts and any(_bare(line).startswith(_CHAINED) for line in lines[max(first - 3, 0):first]):
        first = starts.pop()
    return lines[first:]


def _show_tail(spec: RankSpec) -> None:
    shown, lines = _output_tail(spec)
    if lines:
        _show(f"last {len(lines)} lines of rank {spec.rank}'s output ({shown}):", lines)
    else:
        say(f"rank {spec.rank} wrote nothing to {' or '.join(_files(spec))}")


def _show(title: str, lines: list[str]) -> None:
    say(title)
    sys.stderr.write("".join("  | " + line.rstrip("\n") + "\n" for line in lines))
    sys.stderr.flush()


def failure_tail(spec: RankSpec, kept: dict[Stream, list[str]] | None = None) -> list[str]:
    """What other nodes show of a failed rank: its traceback (``@record``), else its output's tail
    (from its log files, or ``kept``: what the launcher kept of its console streams)."""
    error = read_error_file(spec.error_file)
    if error is not None and error[1]:
        return shown_part(error[1].splitlines()[-TRACEBACK_LINES:])
    kept = kept or {}
    for stream, path in ((Stream.STDERR, spec.stderr_path), (Stream.STDOUT, spec.stdout_path)):
        lines = kept.get(stream) or (tail(path, TRACEBACK_LINES) if path is not None else [])
        if lines:
            return [line.rstrip("\n") for line in shown_part(lines)]
    files = _files(spec)
    if files:
        return [f"(it wrote nothing to {' or '.join(files)})"]
    return ["(its output is on its node's console, above that node's report)"]


def _files(spec: RankSpec) -> list[str]:
    """The rank's output files: stderr's, then stdout's where it is another."""
    return [str(p) for p in dict.fromkeys((spec.stderr_path, spec.stdout_path)) if p is not None]


def report_verdict(failure: Failure, this_node: int) -> None:
    """The root cause every node of a multi-node job prints the same way."""
    where = "this node" if failure.node == this_node else f"node {failure.node}"
    at = f"{where} (host {failure.host}, pid {failure.pid})"
    if failure.cause == LOST:
        say(f"the job failed: node {failure.node}'s launcher stopped answering (killed, or its machine is "
            f"gone), so node {failure.node} counts as failed (exit code {failure.code})")
    elif failure.cause == SIGNALLED:
        name = describe_exit(128 - failure.code).removeprefix("signal ")
        say(f"the job stopped: the launcher on {at} received {name} and stopped its ranks "
            f"(exit code {failure.code})")
    elif failure.cause == STOPPED:
        say(f"the job stalled (--stall_timeout): look at rank {failure.rank} on {at} first: it made no "
            f"progress and its main thread is not in a collective")
    elif failure.cause == WAITING:
        say(f"the job stalled (--stall_timeout): no node found a rank stopped outside a collective; rank "
            f"{failure.rank} on {at} made no progress, waiting in one (a rank may be stuck in the transport)")
    else:
        say(f"the job failed: rank {failure.rank} on {at} failed first with {describe_exit(failure.code)}")
    if failure.tail:
        title = f"main thread of rank {failure.rank}:" if failure.cause in STALLS else \
            f"last lines of rank {failure.rank}'s output:"
        _show(title, [line + "\n" for line in failure.tail])
