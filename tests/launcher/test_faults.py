"""Launcher faults of issue 21 with real processes: the orphan window after Popen, a rendezvous
that never comes, and bad input refused before any rank starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.launcher.conftest import launch, wait_for_files, wait_gone

pytestmark = pytest.mark.timeout(120)

MARKER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    path = os.path.join(sys.argv[1], "pids" + os.environ["RANK"])
    open(path + ".tmp", "w").write(f"{os.getpid()} {child.pid}")
    os.rename(path + ".tmp", path)
    time.sleep(300)
""")


def test_launcher_killed_between_popen_and_the_rest_leaves_no_rank(tmp_path: Path, write_script) -> None:
    # The test hook holds the launcher right after Popen of rank 0: the moment in which it used
    # to have started a rank that the watchdog did not know yet.
    script = write_script("marker.py", MARKER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "-n", "2", str(script), str(tmp_path)], cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "_LOCKSTEP_TEST_PAUSE_AFTER_SPAWN": "60"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_files([tmp_path / "pids0"])
    assert not (tmp_path / "pids1").exists()  # still inside the pause after rank 0's Popen
    launcher.kill()
    launcher.wait(timeout=30)
    pids = [int(p) for p in (tmp_path / "pids0").read_text().split()]
    assert wait_gone(pids, timeout=10) == []


def _second_node(port: int, tmp_path: Path, write_script) -> subprocess.CompletedProcess[str]:
    script = write_script("ran.py", "open('ran', 'w').write('yes')\n")
    start = time.monotonic()
    result = launch(["-n", "1", "--world_size", "2", "--node_rank", "1", "--master_addr", "127.0.0.1",
                     "--master_port", str(port), "--rdzv_timeout", "2", str(script)], cwd=tmp_path, timeout=60)
    assert time.monotonic() - start < 20
    assert not (tmp_path / "ran").exists()  # no rank started
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"127.0.0.1:{port}" in result.stderr
    return result


def test_waiting_launchers_say_every_few_seconds_whom_they_wait_for_and_where(tmp_path: Path, write_script) -> None:
    """Issue 53: a node given a wrong --master_port, and a master whose other node never comes,
    each say what they wait for while they wait, not only when they give up."""
    script = write_script("ran.py", "open('ran', 'w').write('yes')\n")
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master_addr", "127.0.0.1", "--rdzv_timeout", "7"]
    master_port, wrong_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen([sys.executable, "-m", "lockstep", *common, "--node_rank", rank, "--master_port", port,
                              str(script)], cwd=tmp_path, env=env, text=True, stderr=subprocess.PIPE)
            for rank, port in (("0", str(master_port)), ("1", str(wrong_port)))]
    master, second = (job.communicate(timeout=60)[1] for job in jobs)
    assert [job.returncode for job in jobs] == [1, 1] and not (tmp_path / "ran").exists()
    assert master.startswith(f"lockstep: waiting for node(s) 1 to join attempt 0 at 127.0.0.1:{master_port}: "
                             f"5 s of 7 s (--rdzv_timeout)\n"), master
    assert second.startswith(f"lockstep: waiting for the master's rendezvous store at 127.0.0.1:{wrong_port} "
                             f"(nothing accepts connections there yet): 5 s of 7 s (--rdzv_timeout)\n"), second
    assert master.count("\n") == second.count("\n") == 2  # one such line, then the verdict


def test_rendezvous_timeout_when_no_master_listens(tmp_path: Path, write_script) -> None:
    result = _second_node(free_port(), tmp_path, write_script)
    assert "no rendezvous store at" in result.stderr and "nothing accepts connections" in result.stderr
    assert "--rdzv_timeout" in result.stderr


def test_rendezvous_timeout_when_the_port_holder_never_answers(tmp_path: Path, write_script) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        result = _second_node(silent.getsockname()[1], tmp_path, write_script)
    assert "accepts connections but did not answer as a c10d store within 2 s" in result.stderr
    assert "not lockstep's store" in result.stderr


def test_rendezvous_refuses_a_port_held_by_another_protocol(tmp_path: Path, write_script) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def answer_like_a_web_server() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer_like_a_web_server, daemon=True).start()
    try:
        result = _second_node(server.getsockname()[1], tmp_path, write_script)
    finally:
        server.close()
    assert "is held by something that is not lockstep's rendezvous store" in result.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--grace_period", "inf"], "--grace_period: expected seconds > 0 and at most 86400, got 'inf'"),
        (["--grace_period", "nan"], "got 'nan'"),
        (["--grace_period", "1e308"], "got '1e308'"),
        (["--run_directory", "a_file"], "--run_directory 'a_file' is a file, not a folder"),
        (["-n", "2", "--stdout", "a_file/{rank}.out"], "--stdout: rank 1's log file 'a_file/1.out' is under 'a_file'"),
        # judged writable by permissions, fails only when created: the supervisor says so the same way
        (["-n", "2", "--stderr", "/proc/lockstep-test/{rank}.err"], "--stderr: cannot write rank 1's log"),
        (["--run_directory", "/proc/lockstep-test"], "--run_directory '/proc/lockstep-test' cannot be used"),
        # issue 49: read as a host name on port 29400 and waited for until the rendezvous timeout, or
        # (on one node) a misleading bind error; an empty --log-dir became the default folder
        (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "a:b:c"], "--rdzv-endpoint 'a:b:c': too many ':'"),
        (["--rdzv-endpoint", "a:b:c"], "--rdzv-endpoint 'a:b:c': too many ':'"),
        (["--log-dir", ""], "--log-dir '': expected a path"),
    ],
)
def test_bad_input_is_one_line_exit_2_before_any_rank(tmp_path: Path, write_script, argv, needle) -> None:
    (tmp_path / "a_file").write_text("")
    script = write_script("ran.py", "open('ran', 'w').write('yes')\n")
    result = launch([*argv, str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "ran").exists()


def test_a_malformed_endpoint_from_the_environment_is_one_line_exit_2(tmp_path: Path, write_script) -> None:
    script = write_script("ran.py", "open('ran', 'w').write('yes')\n")
    start = time.monotonic()
    result = launch(["--nnodes", "2", "--node-rank", "1", "-n", "1", str(script)], cwd=tmp_path, timeout=60,
                    env={"PET_RDZV_ENDPOINT": "::::"})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("lockstep: error: env PET_RDZV_ENDPOINT '::::': too many ':'; expected HOST")
    assert time.monotonic() - start < 20 and not (tmp_path / "ran").exists()


def test_a_tcp_scheme_before_the_endpoint_is_dropped(tmp_path: Path, write_script) -> None:
    """``tcp://H:P`` (as in init_method) names host H and port P, not a host 'tcp://H:P' on port 29400."""
    port = free_port()
    script = write_script("ran.py", "open('ran', 'w').write('yes')\n")
    result = launch(["--nnodes", "2", "--node-rank", "1", "-n", "1", "--rdzv-endpoint", f"tcp://127.0.0.1:{port}",
                     "--rdzv_timeout", "2", str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 1 and not (tmp_path / "ran").exists(), result.stderr
    assert f"no rendezvous store at 127.0.0.1:{port} after 2 s: nothing accepts connections there" in result.stderr


def test_binary_training_script_is_one_line_instead_of_a_traceback_per_rank(tmp_path: Path) -> None:
    binary = tmp_path / "train.py"
    binary.write_bytes(bytes(range(256)) * 8)
    result = launch(["-n", "2", str(binary)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "is a binary file, not Python source: run a program with -c/--no-python" in result.stderr


def test_a_node_started_before_the_master_waits_for_its_store(tmp_path: Path, write_script) -> None:
    script = write_script("allreduce.py", textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"sum {t.item():g}")
    """))
    port = str(free_port())
    common = ["-n", "1", "--world_size", "2", "--master_addr", "127.0.0.1", "--master_port", port,
              "--rdzv_timeout", "60", "-v"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def node(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "lockstep", *common, "--node_rank", str(rank), str(script)],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    second = node(1)
    assert second.stderr is not None
    waited = []  # node 1 says it waits for the store before the master starts
    while not any(line.startswith("lockstep: waiting up to 60 s for the rendezvous store at") for line in waited):
        waited.append(second.stderr.readline())
        assert waited[-1], waited
    first = node(0)
    outs = [n.communicate(timeout=90) for n in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["sum 2", "sum 2"]
