"""Stalls inside the Trainer's own collectives (issue 37): a rank that stops just before a save, on
its way into a load, or in an evaluation, is caught by --stall_timeout and named, on one node and across two, while
a long checkpoint write that other ranks wait for is not a stall, on any node."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.launcher.stall import STALL_EXIT_CODE
from tests.helpers import free_port
from tests.launcher.conftest import launch

pytestmark = pytest.mark.timeout(150)
REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("trainer_stall_job.py")
# Seconds without progress that make a stall. A healthy step or the set-up of an evaluation can take
# 2 s on two cores shared with other tests' ranks; STALL_S leaves room for that, and the work that
# must not count as a stall (SLOW_S) is longer than it.
STALL_S = "5"
SLOW_S = 6


def _two_nodes(tmp_path: Path, env: dict[str, str], per_node: int) -> list[tuple[int, str, str]]:
    """Two launchers on loopback, both watching for stalls; (code, out, err) of each."""
    port = str(free_port())
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **env}
    nodes = [subprocess.Popen([sys.executable, "-m", "lockstep", "-n", str(per_node), "--world_size", str(2 * per_node),
                               "--node_rank",
                               str(node), "--master_addr", "127.0.0.1", "--master_port", port,
                               "--rdzv_timeout", "60", "--stall_timeout", STALL_S, "--run_directory",
                               str(tmp_path / f"run{node}"), str(JOB), str(tmp_path / f"ckpt{node}")],
                              cwd=tmp_path, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    try:
        outs = [n.communicate(timeout=100) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    return [(n.returncode, out, err) for n, (out, err) in zip(nodes, outs)]


@pytest.fixture(scope="module")
def stopped_before_save(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    """A job whose rank 1 stops just before the save of batch 3: its result, how long it took, and
    its save folder (which keeps the checkpoints of batches 1 and 2)."""
    tmp = tmp_path_factory.mktemp("stopped")
    began = time.monotonic()
    result = launch(["-n", "2", "--stall_timeout", STALL_S, str(JOB), str(tmp / "ckpt")], tmp,
                    env={"STOP_RANK": "1", "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=100)
    return result, time.monotonic() - began, tmp / "ckpt"


def test_a_rank_that_stops_just_before_a_save_is_the_stall_named(stopped_before_save) -> None:
    result, took, _ = stopped_before_save
    assert result.returncode == STALL_EXIT_CODE, result.stderr[-3000:]
    assert took < 60
    err = result.stderr
    assert "rank 1 (pid" in err and "stopped first; last completed step 3" in err, err[-3000:]
    assert "rank 0 (pid" in err and "waiting in a collective; last completed step 3" in err, err[-3000:]
    assert "look at rank 1 first" in err


def test_across_two_nodes_both_launchers_end_naming_the_rank_that_stopped(tmp_path: Path) -> None:
    began = time.monotonic()
    # rank 0 stops on the master's node; node 1's rank waits for it in the save
    results = _two_nodes(tmp_path, {"STOP_RANK": "0"}, per_node=1)
    assert [code for code, _, _ in results] == [STALL_EXIT_CODE] * 2, [err[-2000:] for _, _, err in results]
    assert time.monotonic() - began < 60
    node0, node1 = results[0][2], results[1][2]
    assert "rank 0 (pid" in node0 and "stopped first; last completed step 3" in node0, node0[-3000:]
    assert "look at rank 0 on this node (host" in node0, node0[-3000:]
    assert "look at rank 0 on node 0 (host" in node1, node1[-3000:]


def test_a_long_write_that_the_other_node_waits_for_is_not_a_stall(tmp_path: Path) -> None:
    # each of the 3 writes of rank 0 takes longer than the stall timeout: the next save waits for the
    # first two (training went on meanwhile), and node 1's rank waits for the last one
    began = time.monotonic()
    results = _two_nodes(tmp_path, {"SLOW_WRITE": str(SLOW_S)}, per_node=1)
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert time.monotonic() - began >= 3 * SLOW_S  # the writes, one at a time, were slow
    assert all("finished" in out and "stall" not in err for _, out, err in results)


def test_long_work_of_one_rank_at_fit_end_is_not_a_stall(tmp_path: Path) -> None:
    # rank 0's FIT_END outlasts the stall timeout (a loss curve drawn on a loaded machine did)
    result = launch(["-n", "2", "--stall_timeout", STALL_S, str(JOB), str(tmp_path / "ckpt")], tmp_path,
                    env={"SLOW_FIT_END": str(SLOW_S), "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 finished" in result.stdout and "stall" not in result.stderr, result.stderr[-3000:]


def test_a_rank_that_stops_on_its_way_into_a_load_is_the_stall_named(stopped_before_save, tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    saved = stopped_before_save[2]  # the job that stalled saved batch 2 before it
    assert (saved / "ep0-ba2-rank0.pt").is_file(), sorted(p.name for p in saved.iterdir())
    load = str(saved / "ep0-ba2-rank{rank}.pt")
    result = launch(["-n", "2", "--stall_timeout", STALL_S, str(JOB), str(tmp_path / "again")], tmp_path,
                    env={**env, "LOAD": load, "STOP_IN_LOAD": "1"}, timeout=100)
    assert result.returncode == STALL_EXIT_CODE, result.stderr[-3000:]
    err = result.stderr
    assert "rank 1 (pid" in err and "stopped first" in err and "look at rank 1 first" in err, err[-3000:]


def test_a_rank_that_stops_in_an_evaluation_is_the_stall_named(tmp_path: Path) -> None:
    result = launch(["-n", "2", "--stall_timeout", STALL_S, str(JOB), str(tmp_path / "ckpt")], tmp_path,
                    env={"STOP_IN_EVAL": "1", "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=100)
    assert result.returncode == STALL_EXIT_CODE, result.stderr[-3000:]
    err = result.stderr
    assert "rank 1 (pid" in err and "stopped first" in err and "look at rank 1 first" in err, err[-3000:]
