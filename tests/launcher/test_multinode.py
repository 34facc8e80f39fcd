"""One job across nodes: two launchers on loopback form one world of 4, and agree on the root
cause of a failure, on a lost node, and on restarts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)

# Every rank all-reduces STEPS times (40 unless set) and marks that it is training after step 1;
# rank FAIL_RANK exits with FAIL_CODE at step 3 of attempt 0.
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
            sys.exit(int(os.environ["FAIL_CODE"]))
        dist.all_reduce(x)
        time.sleep(0.02)
    print(f"rank {rank} attempt {attempt} restart count {os.environ['TORCHELASTIC_RESTART_COUNT']} done", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(tmp_path: Path, extra: list[str], env: dict[str, str],
           per_node: tuple[list[str], list[str]] = ([], [])) -> list[subprocess.Popen[str]]:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    port = str(_free_port())
    common = ["-n", "2", "--world_size", "4", "--master_addr", "127.0.0.1", "--master_port", port,
              "--rdzv_timeout", "60", "--stdout", str(tmp_path / "out{rank}"), *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return [subprocess.Popen([sys.executable, "-m", "lockstep", *common, *per_node[node], "--node_rank", str(node),
                              "--run_directory", str(tmp_path / f"run{node}"), str(script), str(tmp_path)],
                             cwd=tmp_path, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in (0, 1)]


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
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"training{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline and nodes[1].poll() is None, nodes[1].communicate()
        time.sleep(0.2)
    nodes[1].send_signal(signal.SIGKILL)
    out, err = nodes[0].communicate(timeout=60)
    nodes[1].communicate()
    assert nodes[0].returncode == 1, err
    assert "the job failed: node 1's launcher stopped answering" in err


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
    # node 1 has no restarts left, so it stops; node 0 would restart and waits for it in vain
    nodes = _nodes(tmp_path, [], {"FAIL_RANK": "3", "FAIL_CODE": "4"},
                   per_node=(["--max_restarts", "1", "--rdzv_timeout", "4"], []))
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [1, 4], outs
    assert "error: node(s) 1 did not join attempt 1 within 4 s (--rdzv_timeout): the job stops" in outs[0][1]
