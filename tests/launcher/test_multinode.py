"""One job across nodes: two launchers on loopback form one world of 4, and agree on the root
cause of a failure, a stall, a lost node or a stopping signal, and on restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from io import BytesIO
from pathlib import Path

import pytest

from lockstep.launcher.job import EXITED, LOST, SIGNALLED, STOPPED, WAITING, Failure, root_cause
from lockstep.launcher.output import ConsolePump
from lockstep.launcher.plan import Stream
from lockstep.launcher.stall import STALL_EXIT_CODE
from tests.helpers import free_port
from tests.launcher.test_stacks_and_stalls import _sections as _stacks

pytestmark = pytest.mark.timeout(150)

# Every rank all-reduces STEPS times (40 unless set) and marks that it is training after step 1;
# rank FAIL_RANK says so on stderr and exits with FAIL_CODE at step 3 of attempt 0.
_JOB = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["LOCKSTEP_RESTART_COUNT"])
    here = sys.argv[1]
    x = torch.ones(1)
    for step in range(int(os.environ.get("STEPS", "40"))):
        if step == 1:
            open(os.path.join(here, f"training{rank}"), "w").close()
        if rank == int(os.environ["FAIL_RANK"]) and step == 3 and attempt == 0:
            open(os.path.join(here, "died"), "w").write(repr(time.time()))
            print(f"rank {rank} gives up at step {step}", file=sys.stderr, flush=True)
            sys.exit(int(os.environ["FAIL_CODE"]))
        dist.all_reduce(x)
        time.sleep(0.02)
    print(f"rank {rank} attempt {attempt} restart count {os.environ['TORCHELASTIC_RESTART_COUNT']} done", flush=True)
""")

# Rank STOP_RANK stops outside any collective at step 3, for good; the others wait for it in an
# all_reduce. Every rank reports progress after each step.
_STALLING = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    import lockstep.dist as ld
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(1)
    for step in range(100000):
        if rank == int(os.environ["STOP_RANK"]) and step == 3:
            open(os.path.join(sys.argv[1], "stopped"), "w").close()
            while True:
                time.sleep(0.05)
        dist.all_reduce(x)
        ld.heartbeat(step + 1)
        time.sleep(0.02)
""")


def _nodes(tmp_path: Path, extra: list[str], env: dict[str, str],
           per_node: tuple[list[str], list[str]] = ([], []), job: str = _JOB,
           node1_first: bool = False) -> list[subprocess.Popen[str]]:
    """The two launchers; with ``node1_first``, node 0 starts once node 1 waits for its store
    (node 1 runs with -v, which says so; the lines read meanwhile are not in its stderr)."""
    script = tmp_path / "job.py"
    script.write_text(job)
    port = str(free_port())
    common = ["-n", "2", "--world_size", "4", "--master_addr", "127.0.0.1", "--master_port", port,
              "--rdzv_timeout", "60", "--stdout", str(tmp_path / "out{rank}"), *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}

    def start(node: int, *more: str) -> subprocess.Popen[str]:
        argv = [*common, *per_node[node], *more, "--node_rank", str(node),
                "--run_directory", str(tmp_path / f"run{node}")]
        return subprocess.Popen([sys.executable, "-m", "lockstep", *argv, str(script), str(tmp_path)], cwd=tmp_path,
                                env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    if not node1_first:
        return [start(0), start(1)]
    second = start(1, "-v")
    assert second.stderr is not None
    said: list[str] = []
    while not said or "waiting up to" not in said[-1]:
        said.append(second.stderr.readline())
        assert said[-1], said
    return [start(0), second]


def _wait_until_training(tmp_path: Path, nodes: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"training{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), nodes[1].communicate()
        time.sleep(0.2)


def test_every_node_reports_the_rank_that_failed_first_and_exits_with_its_code(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path, [], {"FAIL_RANK": "3", "FAIL_CODE": "7"})
    outs = [n.communicate(timeout=120) for n in nodes]
    ended = time.time()
    assert [n.returncode for n in nodes] == [7, 7], outs
    died = float((tmp_path / "died").read_text())
    assert ended - died < 10  # both launchers exited within seconds (communicate() returns in order)
    node0, node1 = outs[0][1], outs[1][1]
    assert "the job failed: rank 3 on node 1 (host" in node0 and "failed first with exit code 7" in node0
    assert "the job failed: rank 3 on this node (host" in node1 and "failed first with exit code 7" in node1
    for err in (node0, node1):
        assert "rank 3's output" in err
        assert "failed first with exit code 1" not in err  # no victim named


def test_a_node_whose_launcher_dies_fails_the_job_on_the_others(tmp_path: Path) -> None:
    # the job would run for minutes, so it can only end through the lost node
    nodes = _nodes(tmp_path, [], {"FAIL_RANK": "-1", "FAIL_CODE": "0", "STEPS": "100000"})
    _wait_until_training(tmp_path, nodes)
    nodes[1].send_signal(signal.SIGKILL)
    out, err = nodes[0].communicate(timeout=60)
    nodes[1].communicate()
    assert nodes[0].returncode == 1, err
    assert "the job failed: node 1's launcher stopped answering" in err


def test_when_node_0s_launcher_dies_the_others_say_so_without_c10d_warnings(tmp_path: Path) -> None:
    # the launcher's own store clients fail too: torch's C++ warnings about them, each with a C++
    # backtrace, used to come before the one line that explains it (issue 37)
    nodes = _nodes(tmp_path, [], {"FAIL_RANK": "-1", "FAIL_CODE": "0", "STEPS": "100000"})
    _wait_until_training(tmp_path, nodes)
    nodes[0].send_signal(signal.SIGKILL)
    _, err = nodes[1].communicate(timeout=60)
    nodes[0].communicate()
    assert nodes[1].returncode == 1, err
    assert "[c10d]" not in err and "frame #" not in err, err
    assert err.splitlines()[-1].startswith("lockstep: the job failed: the rendezvous store at 127.0.0.1:"), err


@pytest.mark.parametrize("users_level", [None, "INFO"])
def test_the_launchers_quiet_c10d_leaves_the_ranks_environment_as_it_was(users_level: str | None) -> None:
    env = dict(os.environ)
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    if users_level is not None:
        env["TORCH_CPP_LOG_LEVEL"] = users_level
    code = ("import os; from lockstep.launcher.job import tcp_store; tcp_store(); "
            "print(os.environ.get('TORCH_CPP_LOG_LEVEL'))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == str(users_level), result.stderr


def test_restarts_are_agreed_across_nodes(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path, ["--max_restarts", "1"], {"FAIL_RANK": "1", "FAIL_CODE": "5"})
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    for err in (outs[0][1], outs[1][1]):
        assert "rank 1 on" in err and "failed first with exit code 5" in err
        assert "restarting every node's ranks (1 of 1)" in err
    lines = {outs[0][0].strip(), outs[1][0].strip(), *((tmp_path / f"out{r}").read_text().strip() for r in (1, 3))}
    assert {line.splitlines()[-1] for line in lines} == {
        f"rank {r} attempt 1 restart count 1 done" for r in range(4)}


def test_a_node_that_does_not_come_back_for_a_restart_fails_the_job_clearly(tmp_path: Path) -> None:
    # node 1 has no restarts left, so it stops; node 0 would restart and waits for it in vain (node 1
    # waits for the store before node 0 starts, so that attempt 0 does not hang on node 1's start-up)
    nodes = _nodes(tmp_path, [], {"FAIL_RANK": "3", "FAIL_CODE": "4"},
                   per_node=(["--max_restarts", "1", "--rdzv_timeout", "4"], []), node1_first=True)
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [1, 4], outs
    assert "error: node(s) 1 did not join attempt 1 within 4 s (--rdzv_timeout): the job stops" in outs[0][1]


def test_a_launcher_started_again_in_place_of_a_killed_one_joins_the_masters_restart(tmp_path: Path) -> None:
    """Node 1's launcher is killed; node 0 restarts (attempt 1) and waits for it. A launcher started
    again for node 1 knows nothing of attempts: it must join the master's at once, not begin its own
    attempt 0, start ranks into that attempt's finished rendezvous, find its verdict and spend a
    restart of its own on a failure it never saw (with the master a few attempts ahead, more
    restarts than it has)."""
    import datetime

    from lockstep.launcher.store import tcp_store

    env = {"FAIL_RANK": "-1", "FAIL_CODE": "0", "STEPS": "150"}
    nodes = _nodes(tmp_path, ["--max_restarts", "1", "--rdzv_timeout", "30"], env)
    _wait_until_training(tmp_path, nodes)
    nodes[1].kill()
    nodes[1].communicate()
    port = int(nodes[0].args[nodes[0].args.index("--master_port") + 1])
    store = tcp_store()("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
    deadline = time.monotonic() + 60
    while store.add("lockstep/attempt1/joined", 0) < 1:  # the master waits in attempt 1
        assert time.monotonic() < deadline and nodes[0].poll() is None, nodes[0].communicate()
        time.sleep(0.1)
    again = subprocess.Popen(nodes[1].args, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [n.communicate(timeout=90) for n in (nodes[0], again)]
    assert [nodes[0].returncode, again.returncode] == [0, 0], outs
    assert "node 1's launcher stopped answering" in outs[0][1], outs[0][1]
    assert "restarting" not in outs[1][1] and "the job failed" not in outs[1][1], outs[1][1]
    lines = {outs[0][0].strip(), outs[1][0].strip(), *((tmp_path / f"out{r}").read_text().strip() for r in (1, 3))}
    assert {line.splitlines()[-1] for line in lines} == {
        f"rank {r} attempt 1 restart count 1 done" for r in range(4)}


def test_a_failed_local_rank_0s_last_lines_reach_every_node(tmp_path: Path) -> None:
    # rank 2 is node 1's local rank 0: its output goes to node 1's console, not to a file
    nodes = _nodes(tmp_path, [], {"FAIL_RANK": "2", "FAIL_CODE": "7"})
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [7, 7], outs
    node0, node1 = outs[0][1], outs[1][1]
    assert "the job failed: rank 2 on node 1 (host" in node0
    assert "last lines of rank 2's output:\n  | rank 2 gives up at step 3\n" in node0, node0
    assert "on its node's console" not in node0
    assert node1.startswith("rank 2 gives up at step 3\n")  # its own console shows it as it was written


@pytest.mark.parametrize("node1_watches", [True, False], ids=["both-watch", "node1-learns-from-node0"])
def test_a_stall_names_the_rank_that_stopped_on_every_node(tmp_path: Path, node1_watches: bool) -> None:
    # node 0's ranks only wait, so node 0 may report the stall first; without --stall_timeout,
    # node 1 learns of it from node 0 alone
    watch = ["--stall_timeout", "2"]
    nodes = _nodes(tmp_path, [], {"STOP_RANK": "2"}, per_node=(watch, watch if node1_watches else []), job=_STALLING)
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [STALL_EXIT_CODE] * 2, outs
    node0, node1 = outs[0][1], outs[1][1]
    if not node1_watches:
        assert "stall: another node found the job stalled (--stall_timeout)" in node1, node1
    assert "look at rank 2 on node 1 (host" in node0, node0
    assert "look at rank 2 on this node (host" in node1, node1
    for err in (node0, node1):
        assert "main thread of rank 2:\n  |" in err and "no node found a rank stopped" not in err
    # each node printed its own ranks' stacks, and only those
    stacks0, stacks1 = _stacks(node0), _stacks(node1)
    assert set(stacks0) == {0, 1} and set(stacks1) == {2, 3}, (node0, node1)
    assert all("in all_reduce" in stacks0[r] for r in (0, 1)) and "in all_reduce" in stacks1[3]
    assert "in all_reduce" not in stacks1[2] and "job.py" in stacks1[2]
    assert "rank 2 (pid" in node1 and "stopped first" in node1


@pytest.mark.parametrize(("node", "signum"), [(1, signal.SIGTERM), (0, signal.SIGHUP)])
def test_a_stopping_signal_to_one_launcher_is_the_cause_every_node_reports(
        tmp_path: Path, node: int, signum: signal.Signals) -> None:
    nodes = _nodes(tmp_path, [], {"FAIL_RANK": "-1", "FAIL_CODE": "0", "STEPS": "100000"})
    _wait_until_training(tmp_path, nodes)
    nodes[node].send_signal(signum)
    outs = [n.communicate(timeout=60) for n in nodes]
    assert [n.returncode for n in nodes] == [128 + signum] * 2, outs
    other = outs[1 - node][1]
    assert f"the job stopped: the launcher on node {node} (host" in other, other
    assert f"received {signum.name} and stopped its ranks (exit code {128 + signum})" in other
    assert "stopped answering" not in other and "failed first" not in other
    assert f"received {signum.name}, forwarding it to every rank" in outs[node][1]


def test_a_signal_while_a_launcher_waits_for_the_store_is_the_cause_the_others_report(tmp_path: Path) -> None:
    """Node 1 is signalled while it waits for node 2 to join, inside a store wait, and must still
    record the signal: without it, the others would find node 1 lost (exit 1) once node 2 joins."""
    import datetime

    from lockstep.launcher.store import tcp_store

    script = tmp_path / "job.py"
    script.write_text("import time\ntime.sleep(60)\n")
    port = free_port()

    def start(node: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "lockstep", "-n", "1", "--world_size", "3", "--node_rank", str(node),
             "--master_addr", "127.0.0.1", "--master_port", str(port), "--rdzv_timeout", "60",
             "--run_directory", str(tmp_path / f"run{node}"), str(script)],
            cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)

    nodes = [start(0), start(1)]
    try:
        store = tcp_store()("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
        deadline = time.monotonic() + 60
        while store.add("lockstep/attempt0/joined", 0) < 2:  # both joined, and wait for node 2
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes)
            time.sleep(0.1)
        nodes[1].send_signal(signal.SIGTERM)
        _, said = nodes[1].communicate(timeout=30)
        assert nodes[1].returncode == 128 + signal.SIGTERM, said
        nodes.append(start(2))
        outs = {n: nodes[n].communicate(timeout=60)[1] for n in (0, 2)}
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.communicate()
    assert [nodes[n].returncode for n in (0, 2)] == [128 + signal.SIGTERM] * 2, outs
    for err in outs.values():
        assert "the job stopped: the launcher on node 1 (host" in err and "received SIGTERM" in err, err
        assert "stopped answering" not in err, err


def test_node_0_signalled_before_the_other_nodes_joined_stops_at_once(tmp_path: Path) -> None:
    """Node 0 is signalled while it waits for node 1, which never comes. Before it closes the
    store it waits for the nodes that joined to read the verdict, and none did: it read their
    keys, which no one set, and each read waited out the store's 10 s call deadline."""
    import datetime

    from lockstep.launcher.store import tcp_store

    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "-n", "1", "--world_size", "2", "--node_rank", "0",
         "--master_addr", "127.0.0.1", "--master_port", str(port), "--run_directory", str(tmp_path / "run"),
         str(script)], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        store = tcp_store()("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
        deadline = time.monotonic() + 60
        while store.add("lockstep/attempt0/joined", 0) < 1:
            assert time.monotonic() < deadline and node.poll() is None
            time.sleep(0.1)
        signalled = time.monotonic()
        node.send_signal(signal.SIGTERM)
        _, said = node.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if node.poll() is None:
            node.kill()
            node.communicate()
    assert node.returncode == 128 + signal.SIGTERM, said
    assert took < 6, (took, said)  # the grace period is 3 s, and no rank runs yet


def _failure(cause: str, when: float, rank: int = 0) -> Failure:
    return Failure(0, "h", rank, 1, when, cause=cause)


@pytest.mark.parametrize(("failures", "expected"), [
    ([_failure(EXITED, 2.0, 1), _failure(EXITED, 1.0, 2)], 1),  # the earliest
    ([_failure(WAITING, 1.0), _failure(STOPPED, 5.0)], 1),  # a stopped rank, whenever it was seen
    ([_failure(WAITING, 2.0), _failure(WAITING, 1.0)], 1),  # no stopped rank: the earliest waiting one
    ([_failure(LOST, 1.0), _failure(EXITED, 1.0)], 1),  # a tie: the rank, not the lost node
    ([_failure(EXITED, 2.0), _failure(SIGNALLED, 1.0)], 1),  # a signal before its victims
])
def test_root_cause(failures: list[Failure], expected: int) -> None:
    assert root_cause(failures) is failures[expected]


def test_a_console_pump_passes_bytes_unchanged_and_keeps_the_last_lines() -> None:
    read_fd, write_fd = os.pipe()
    console = BytesIO()
    pump = ConsolePump(os.fdopen(read_fd, "rb"), console, Stream.STDERR)
    written = b"".join(b"line %d\r\n" % i for i in range(100)) + b"\x1b[1mno newline"
    os.write(write_fd, written)
    os.close(write_fd)
    assert not pump.pump()
    pump.close()
    assert console.getvalue() == written
    assert pump.last_lines(2) == ["line 99\n", "\x1b[1mno newline\n"]
