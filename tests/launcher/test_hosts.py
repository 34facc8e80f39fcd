"""Nodes on separate hosts (network namespaces with addresses of their own, tests/launcher/netns.py):
a link that goes down mid-run, SIGTERM to a node cut off from the master, a partition that heals
under --max_restarts, and the interface the ranks use on multi-homed hosts."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from lockstep.launcher.interface import interface_env, route_to
from lockstep.launcher.store import StoreClient, Stopped, StoreLost, tcp_store
from lockstep.launcher.output import RankLogs
from lockstep.launcher.ranks import Rank, Waiter
from tests.checkpoint.test_faults import JOB as TRAIN_JOB, batches_done
from tests.helpers import assert_bitwise
from tests.launcher import netns
from tests.launcher.netns import Hosts, make_hosts

pytestmark = pytest.mark.timeout(150)

REPO = Path(__file__).resolve().parents[2]
PORT = 29400  # every host has its own ports: no clash with other tests
GRACE = 3

# Every rank all-reduces until the test writes "cut" beside it; the ranks agree on the step at
# which they saw it (a rank that looked a moment earlier than the other must not wait in an
# all-reduce that its peer never joins), say so in "left<rank>", and wait for "down", which the
# test writes once the link is cut. Rank SPILL_RANK then writes SPILL_BYTES to stdout, which pass
# through its launcher (waiting for the store meanwhile), and says so in "spilled". Then every rank
# all-reduces once more, which blocks for good across the partition.
_JOB = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    here = sys.argv[1]
    dist.init_process_group("gloo")
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = dist.get_rank()
    print(f"rank {rank} GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')} "
          f"NCCL_SOCKET_IFNAME={os.environ.get('NCCL_SOCKET_IFNAME')}", flush=True)
    x = torch.ones(1)
    for step in range(int(os.environ.get("STEPS", "1000000"))):
        if step == 2:
            open(os.path.join(here, f"training{rank}"), "w").close()
        seen = torch.tensor([float(os.path.exists(os.path.join(here, "cut")))])
        dist.all_reduce(seen)
        if seen.item():
            break
        time.sleep(0.02)
    else:
        print(f"rank {rank} done", flush=True)
        sys.exit(0)
    open(os.path.join(here, f"left{rank}"), "w").close()
    while not os.path.exists(os.path.join(here, "down")):
        time.sleep(0.05)
    if rank == int(os.environ.get("SPILL_RANK", "-1")):
        time.sleep(0.5)
        sys.stdout.write("x" * int(os.environ["SPILL_BYTES"]) + "\\n")
        sys.stdout.flush()
        open(os.path.join(here, "spilled"), "w").write(repr(time.time()))
    dist.all_reduce(x)
""")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    yield from make_hosts(2)


@pytest.fixture
def four_hosts() -> Iterator[Hosts]:
    yield from make_hosts(4)


@pytest.fixture
def multihomed() -> Iterator[Hosts]:
    yield from make_hosts(2, networks=2)


class Node:
    """One launcher on a namespace host; its console goes to files (nothing to drain meanwhile).
    Node ``node`` of a job runs on host ``first + node`` (the master on host ``first``)."""

    def __init__(self, hosts: Hosts, node: int, tmp: Path, argv: Sequence[str], extra: Sequence[str] = (),
                 env: dict[str, str] | None = None, master_network: int = 0, first: int = 0) -> None:
        self.out_path, self.err_path = tmp / f"node{node}.out", tmp / f"node{node}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = hosts.popen(first + node, [
                sys.executable, "-m", "lockstep", "-n", "1", "--world_size", "2", "--node_rank", str(node),
                "--master_addr", hosts.address(first, master_network), "--master_port", str(PORT),
                "--run_directory", str(tmp / f"run{node}"), "--grace_period", str(GRACE), *extra, *argv],
                cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=out, stderr=err)
        self.ended: float | None = None

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher is still running after {timeout:g} s:\n{self.err}")
        self.ended = self.ended or time.monotonic()
        return code

    def poll_end(self) -> None:
        if self.ended is None and self.proc.poll() is not None:
            self.ended = time.monotonic()

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")


def _start(hosts: Hosts, tmp: Path, extra: Sequence[str] = (), env: dict[str, str] | None = None,
           first: int = 0) -> list[Node]:
    script = tmp / "job.py"
    script.write_text(_JOB)
    return [Node(hosts, n, tmp, [str(script), str(tmp)], extra, env, first=first) for n in (0, 1)]


def _wait_for(paths: list[Path], nodes: list[Node], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        ended = [n for n in nodes if n.proc.poll() is not None]
        assert not ended and time.monotonic() < deadline, (
            f"waiting for {[p.name for p in paths]}:\n" + "\n".join(n.err for n in nodes))
        time.sleep(0.1)


def _cut_mid_run(hosts: Hosts, tmp: Path, nodes: list[Node], host: int) -> float:
    """Wait until both ranks train, tell them, cut ``host``'s link; when it was cut."""
    _out_of_their_loop(tmp, nodes)
    return _cut(hosts, tmp, host)


def _out_of_their_loop(tmp: Path, nodes: list[Node]) -> None:
    """Wait until both ranks train, then until both left their loop of all-reduces."""
    _wait_for([tmp / "training0", tmp / "training1"], nodes)
    (tmp / "cut").touch()
    _wait_for([tmp / "left0", tmp / "left1"], nodes)


def _cut(hosts: Hosts, tmp: Path, host: int) -> float:
    """Cut ``host``'s link and tell the ranks; when it was cut."""
    hosts.cut(host)
    cut_at = time.monotonic()
    (tmp / "down").touch()
    return cut_at


def _wait_both(nodes: list[Node], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(n.proc.poll() is None for n in nodes) and time.monotonic() < deadline:
        for n in nodes:
            n.poll_end()
        time.sleep(0.1)
    return [n.wait(5) for n in nodes]


def _no_process_left(hosts: Hosts) -> None:
    every = range(hosts.count)
    deadline = time.monotonic() + 10
    while any(hosts.pids(h) for h in every) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [hosts.pids(h) for h in every] == [[] for _ in every]


def test_a_partition_ends_both_nodes_within_60_s_and_the_isolated_one_says_it_lost_the_master(
        four_hosts: Hosts, tmp_path: Path) -> None:
    # Two jobs at once, each on a pair of hosts (most of the time goes to waiting for deadlines):
    # in one node 1 is cut off, in the other the master. Rank 1 (node 1's local rank 0, on its
    # launcher's console) writes 1 MB after the cut: its launcher must go on draining the pipe
    # while it waits for the store that no longer answers.
    hosts, jobs = four_hosts, {}
    for cut, first in ((1, 0), (0, 2)):
        tmp = tmp_path / f"cut{cut}"
        tmp.mkdir()
        jobs[cut] = (tmp, first, _start(hosts, tmp, env={"SPILL_RANK": "1", "SPILL_BYTES": str(1 << 20)}, first=first))
    cut_at = {cut: _cut_mid_run(hosts, tmp, nodes, first + cut) for cut, (tmp, first, nodes) in jobs.items()}
    codes = _wait_both([n for _, _, nodes in jobs.values() for n in nodes], timeout=70)
    assert codes == [1, 1, 1, 1], [n.err for _, _, nodes in jobs.values() for n in nodes]
    for cut, (tmp, first, nodes) in jobs.items():
        assert all(n.ended is not None and n.ended - cut_at[cut] < 60 for n in nodes), \
            (cut, [n.ended - cut_at[cut] for n in nodes])
        node0, node1 = nodes[0].err, nodes[1].err
        assert "the job failed: node 1's launcher stopped answering" in node0, (cut, node0)
        where = f"{hosts.address(first)}:{PORT}"
        assert f"the job failed: the rendezvous store at {where}, which node 0's launcher hosts, stopped answering" \
            in node1, (cut, node1)
        assert "lost the master, silent since " in node1 and " s ago); node 0 counts as failed" in node1, (cut, node1)
        assert (tmp / "spilled").exists(), (cut, node1, len(nodes[1].out), time.monotonic() - cut_at[cut])
        assert "x" * (1 << 20) in nodes[1].out, cut
    _no_process_left(hosts)


def test_sigterm_ends_a_node_cut_off_from_the_master_in_its_grace_period_and_one_retrying_it_at_once(
        four_hosts: Hosts, tmp_path: Path) -> None:
    # Two jobs at once, each on a pair of hosts (most of the time goes to waiting for deadlines).
    # In the first, node 1's launcher waits for an answer from the store when it is signalled, and
    # the ranks ignore SIGTERM, so only the launcher's teardown ends them: after the grace period.
    # In the second, node 1's launcher would restart and retries the master that it cannot reach.
    hosts, waits, retries = four_hosts, tmp_path / "waits", tmp_path / "retries"
    waits.mkdir()
    retries.mkdir()
    waiting = _start(hosts, waits, env={"IGNORE_TERM": "1"}, first=0)
    retrying = _start(hosts, retries, ["--max_restarts", "1", "--rdzv_timeout", "120"], first=2)
    # both jobs out of their loops before either link is cut: a cut node stops waiting for the
    # store after about 10 s, and the second job may take that long to start on a busy machine
    _out_of_their_loop(waits, waiting)
    _out_of_their_loop(retries, retrying)
    _cut(hosts, waits, 1)
    _cut(hosts, retries, 3)
    deadline = time.monotonic() + 40

    time.sleep(1.0)  # node 1's launcher now waits for an answer from the store that will not come
    signalled = time.monotonic()
    waiting[1].proc.send_signal(signal.SIGTERM)
    code = waiting[1].wait(timeout=GRACE + 30)
    took = time.monotonic() - signalled
    err = waiting[1].err
    assert code == 128 + signal.SIGTERM, err
    assert took < GRACE + 4, (took, err, waiting[1].out)  # + the exit of a Python that loaded torch, on a busy CI
    assert "received SIGTERM, forwarding it to every rank" in err
    assert f"did not exit within the {GRACE} s grace period" in err, err

    while "rejoining the master at" not in retrying[1].err:
        assert time.monotonic() < deadline and retrying[1].proc.poll() is None, retrying[1].err
        time.sleep(0.1)
    time.sleep(1.0)
    signalled = time.monotonic()
    retrying[1].proc.send_signal(signal.SIGTERM)
    code = retrying[1].wait(timeout=30)
    took = time.monotonic() - signalled
    err = retrying[1].err
    assert code == 128 + signal.SIGTERM, err
    assert took < GRACE + 4, (took, err)
    assert "received SIGTERM while waiting for the rendezvous store" in err, err
    retrying[0].proc.send_signal(signal.SIGTERM)  # it waits for node 1 to rejoin
    assert retrying[0].wait(timeout=30) == 128 + signal.SIGTERM, retrying[0].err

    assert waiting[0].wait(timeout=60) == 1, waiting[0].err
    _no_process_left(hosts)


def _train(hosts: Hosts, tmp: Path, restarts: int) -> list[Node]:
    """tests/checkpoint/train_job.py on both hosts, each with a save folder of its own."""
    return [Node(hosts, n, tmp, [str(TRAIN_JOB), "--folder", str(tmp / f"saves{n}"), "--out", str(tmp / f"final{n}.pt"),
                                 "--sleep", "0.15", "--progress", str(tmp / f"progress{n}")],
                 ["--max_restarts", str(restarts), "--rdzv_timeout", "60"]) for n in (0, 1)]


@pytest.mark.timeout(240)
def test_a_partition_that_heals_re_forms_the_job_and_ends_as_the_uninterrupted_run(
        hosts: Hosts, tmp_path: Path) -> None:
    # the uninterrupted run, on this host's loopback, trains meanwhile
    reference = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", str(TRAIN_JOB), "--folder",
                                  str(tmp_path / "clean"), "--out", str(tmp_path / "clean.pt")], cwd=REPO,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    try:
        _partition_and_heal(hosts, tmp_path)
        _, reference_err = reference.communicate(timeout=60)
    finally:
        reference.kill()
    assert reference.returncode == 0, reference_err
    assert_bitwise(torch.load(tmp_path / "final0.pt", weights_only=True),
                   torch.load(tmp_path / "clean.pt", weights_only=True))
    _no_process_left(hosts)


def _partition_and_heal(hosts: Hosts, tmp_path: Path) -> None:
    nodes = _train(hosts, tmp_path, restarts=2)
    progress = tmp_path / "progress0"
    deadline = time.monotonic() + 150
    # after the checkpoint of batch 8, before the end (24 batches)
    while batches_done(progress) < 10:
        assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes), [n.err for n in nodes]
        time.sleep(0.1)
    hosts.cut(1)
    while "rejoining the master at" not in nodes[1].err:  # both sides found the other gone
        assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes), [n.err for n in nodes]
        time.sleep(0.1)
    time.sleep(2)  # node 1 retries the master that it cannot reach
    hosts.heal(1)
    codes = _wait_both(nodes, timeout=150)
    node0, node1 = nodes[0].err, nodes[1].err
    assert codes == [0, 0], (node0, node1)
    assert "node 1's launcher stopped answering" in node0 and "restarting every node's ranks (1 of 2)" in node0, node0
    assert "lost the master" in node1 and "rejoining the master at" in node1, node1
    assert not (tmp_path / "saves1").exists() or not any((tmp_path / "saves1").iterdir())  # no shared disk
    resumed = re.search(r"attempt [12] resumed at batch (\d+)ba", nodes[0].out)
    assert resumed and int(resumed[1]) >= 8, nodes[0].out  # from a checkpoint that node 1 never had


def test_ranks_use_the_interface_that_routes_to_the_master(multihomed: Hosts, tmp_path: Path) -> None:
    # network 0 is down at the switch; the master's address is on network 1
    for h in (0, 1):
        multihomed.cut(h, network=0)
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    # node 1 names Gloo's interface itself: only NCCL's is chosen for it
    nodes = [Node(multihomed, n, tmp_path, [str(script), str(tmp_path)], ["-v"],
                  {"STEPS": "5", **({"GLOO_SOCKET_IFNAME": "net1"} if n else {})}, master_network=1) for n in (0, 1)]
    assert [n.wait(90) for n in nodes] == [0, 0], [n.err for n in nodes]
    master = multihomed.address(0, 1)
    chose = f"ranks use the interface net1 ({{}}), which routes to the master {master}, for "
    assert chose.format(multihomed.address(0, 1)) + "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME\n" in nodes[0].err
    assert chose.format(multihomed.address(1, 1)) + "NCCL_SOCKET_IFNAME; GLOO_SOCKET_IFNAME=net1 as set\n" \
        in nodes[1].err, nodes[1].err
    for h, node in enumerate(nodes):
        assert f"rank {h} GLOO_SOCKET_IFNAME=net1 NCCL_SOCKET_IFNAME=net1" in node.out, node.out


def test_the_interface_is_left_alone_on_loopback_or_where_the_user_named_one() -> None:
    assert route_to("127.0.0.1") is not None and route_to("127.0.0.1").interface == "lo"
    added, line = interface_env("127.0.0.1", {})
    assert added == {} and "loopback" in line
    added, line = interface_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"})
    assert added == {} and "GLOO_SOCKET_IFNAME=a, NCCL_SOCKET_IFNAME=b" in line
    assert route_to("no-such-host.invalid") is None


def test_a_store_call_that_gets_no_answer_ends_at_its_deadline_and_the_client_stays_lost() -> None:
    # a listener that accepts and never answers stands for a master behind a silent network
    store_class = tcp_store()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        looks: list[float] = []
        client = StoreClient(lambda: store_class("127.0.0.1", port, None, False, datetime.timedelta(seconds=60)),
                             f"127.0.0.1:{port}", deadline=1.0)
        start = time.monotonic()
        with pytest.raises(StoreLost, match="no answer within 1 s"):
            client.call("add", "k", 1, meanwhile=lambda s: (looks.append(s), time.sleep(s)))
        assert time.monotonic() - start < 2.0
        assert looks and max(looks) <= 0.1  # the main thread's other work was never left for long
        start = time.monotonic()
        with pytest.raises(StoreLost):
            client.call("add", "k", 1)
        assert time.monotonic() - start < 0.1

        def stop(seconds: float) -> None:
            raise Stopped(signal.SIGTERM)

        other = StoreClient(lambda: store_class("127.0.0.1", port, None, False, datetime.timedelta(seconds=60)),
                            f"127.0.0.1:{port}", deadline=30.0)
        start = time.monotonic()
        with pytest.raises(Stopped):
            other.call("add", "k", 1, meanwhile=stop)
        assert time.monotonic() - start < 1.0


def test_a_call_abandoned_at_a_stopping_signal_leaves_the_client_usable_to_record_the_signal() -> None:
    store_class = tcp_store()
    server = store_class("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    client = StoreClient(lambda: store_class("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=60)),
                         f"127.0.0.1:{server.port}", deadline=10.0)

    def stop(seconds: float) -> None:
        raise Stopped(signal.SIGTERM)

    with pytest.raises(Stopped):
        client.call("wait", ["k"], meanwhile=stop)  # waits for a key no one has set yet
    server.set("k", "1")  # the abandoned call ends on its thread; the next one runs behind it
    assert client.call("add", "recorded", 1) == 1 and server.add("recorded", 0) == 1


def test_a_rank_exit_taken_while_a_store_call_was_out_does_not_wake_the_monitor_again_and_again() -> None:
    # the supervisor's Waiter during a store call sees the exit; the monitor's Waiter must not spin on it
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    rank = Rank(None, proc, os.pidfd_open(proc.pid), RankLogs(None, None))  # type: ignore[arg-type]
    wake_r, wake_w = os.pipe()
    try:
        with Waiter([rank], wake_r, ()) as monitor:
            with Waiter([rank], wake_r, ()) as during_call:
                deadline = time.monotonic() + 30
                while not during_call.wait(0.1)[1]:
                    assert time.monotonic() < deadline
            assert rank.returncode == 0
            monitor.wait(0)  # takes note that the rank is gone
            start = time.monotonic()
            assert monitor.wait(0.3) == ([], [])
            assert time.monotonic() - start >= 0.25
    finally:
        rank.close()
        os.close(wake_r)
        os.close(wake_w)


@pytest.mark.timeout(60)
def test_the_namespaces_of_a_test_process_killed_by_sigkill_are_swept(hosts: Hosts) -> None:
    # the `hosts` fixture: namespace hosts can be made here (else it skipped)
    code = ("import os, signal; from tests.launcher.netns import Hosts; h = Hosts(1); print(h.x, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    died = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert died.returncode == -signal.SIGKILL, died.stderr
    x = int(died.stdout)
    left = {f"lst{x}sw", f"lst{x}h0"}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert left <= {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert left <= set(netns.sweep())
    assert hosts.name(0) in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout  # alive
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not left & {line.split()[0] for line in listed.splitlines() if line.strip()}


_SILENT_NAME_SERVER = ("import socket, sys, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                       "s.bind((sys.argv[1], 53)); print('up', flush=True); time.sleep(300)")
_NO_ANSWER_NAME = "lockstep-master.invalid"


@contextlib.contextmanager
def _silent_names(hosts: Hosts, asker: int) -> Iterator[None]:
    """Host ``asker`` asks host 0 for names, and host 0's name server reads each query and never
    answers: the C library would retry for a minute per name (timeout:30 attempts:2)."""
    silent = hosts.popen(0, [sys.executable, "-c", _SILENT_NAME_SERVER, hosts.address(0)], stdout=subprocess.PIPE)
    assert silent.stdout is not None and silent.stdout.readline() == b"up\n"
    folder = Path("/etc/netns") / hosts.name(asker)  # `ip netns exec` puts these files in /etc for the host
    try:
        folder.mkdir(parents=True)
        (folder / "resolv.conf").write_text(f"nameserver {hosts.address(0)}\noptions timeout:30 attempts:2\n")
        (folder / "hosts").write_text("127.0.0.1 localhost\n")
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only if no one else keeps files there


@pytest.mark.timeout(150)
def test_a_master_name_no_name_server_answers_for_ends_the_launcher_in_time_and_sigterm_ends_it_at_once(
        hosts: Hosts, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    unresolvable = ["--master_addr", _NO_ANSWER_NAME, "--rdzv_timeout", "3"]
    with _silent_names(hosts, 1):
        # two launchers at once: one is left to give up, the other is stopped while it waits
        (tmp_path / "term").mkdir()
        started = time.monotonic()
        node = Node(hosts, 1, tmp_path, [str(script), str(tmp_path)], unresolvable)
        stopped = Node(hosts, 1, tmp_path / "term", [str(script), str(tmp_path)], unresolvable)
        time.sleep(3)  # the launcher has started and waits for the name
        signalled = time.monotonic()
        stopped.proc.send_signal(signal.SIGTERM)
        code = stopped.wait(timeout=30)
        stopping = time.monotonic() - signalled
        assert node.wait(timeout=60) == 1, node.err
        took = time.monotonic() - started
    # the interface lookup gives up after 10 s, then the rendezvous after its 3 s (+ start-up)
    assert 10 + 3 <= took < 10 + 3 + 8, (took, node.err)
    assert "error: the master's name 'lockstep-master.invalid' did not resolve on this host within 3 s" in node.err
    assert code == 128 + signal.SIGTERM and stopping < 3, (code, stopping, stopped.err)
    # at 3 s it looks up the master's name for the ranks' interface (10 s), before the rendezvous
    assert "received SIGTERM while looking up the master" in stopped.err, stopped.err


@pytest.mark.timeout(150)
def test_the_master_and_a_single_node_launcher_look_up_names_with_a_deadline(hosts: Hosts, tmp_path: Path) -> None:
    # On host 1, whose name server never answers, each given a name as --master_addr: a launcher of
    # one node, which looked it up in bind() for the C library's minute and more, and two masters
    # of two nodes, whose store (c10d's TCPStore then) connected a client to itself that looked the
    # name up on the main thread, deaf to signals, retrying for the store's 30-minute timeout
    # (issue 49). The store a launcher serves now looks nothing up: the master goes on to wait for
    # the other node, and ends at --rdzv_timeout.
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    name = ["--master_addr", _NO_ANSWER_NAME]
    with _silent_names(hosts, 1):
        started = time.monotonic()
        with open(tmp_path / "single.err", "wb") as err:
            single = hosts.popen(1, [sys.executable, "-m", "lockstep", "-n", "1", *name, "--run_directory",
                                     str(tmp_path / "single"), str(script)],
                                 cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=err, stderr=err)
        (tmp_path / "term").mkdir()
        left = Node(hosts, 0, tmp_path, [str(script)], [*name, "--rdzv_timeout", "5"], first=1)
        stopped = Node(hosts, 0, tmp_path / "term", [str(script)], [*name, "--master_port", str(PORT + 1)], first=1)
        time.sleep(3)  # started: looking the name up
        stopped.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        stopped_code = stopped.wait(timeout=30)
        stopping = time.monotonic() - signalled
        try:
            code = single.wait(timeout=60)
        finally:
            if single.poll() is None:
                single.kill()
        single_took = time.monotonic() - started
        left_code = left.wait(timeout=60)
        left_took = time.monotonic() - started
    said = (tmp_path / "single.err").read_text()
    assert code == 2 and single_took < 10 + 8, (code, single_took, said)
    assert f"error: cannot bind the store port on the master's name '{_NO_ANSWER_NAME}' did not resolve within 10 s" \
        in said, said
    assert stopped_code == 128 + signal.SIGTERM and stopping < 3, (stopped_code, stopping, stopped.err)
    assert "received SIGTERM" in stopped.err, stopped.err
    assert left_code == 1 and left_took < 10 + 10, (left_code, left_took, left.err)  # waited for after single
    assert "error: node(s) 1 did not join attempt 0 within 5 s" in left.err, left.err
