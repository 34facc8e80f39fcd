"""What schedulers tell the launcher: SLURM's variables under srun, Kubernetes' PyTorchJob variables,
Slurm's hostlist syntax and which source wins (pure parsing); then two srun tasks that train as one
job, on loopback and on two namespace hosts that resolve the nodelist with hosts files of their own."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.launcher.cli import parse_plan
from lockstep.launcher.plan import LaunchError
from lockstep.launcher.slurm import PORT_BASE, PORT_SPAN, expand_hostlist
from tests.helpers import shared_run


@pytest.mark.parametrize(("text", "hosts"), [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-[001-003]-x", ["gpu-001-x", "gpu-002-x", "gpu-003-x"]),
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("r[1-2]n[3-4]-ib", ["r1n3-ib", "r1n4-ib", "r2n3-ib", "r2n4-ib"]),
    ("node[8-10]", ["node8", "node9", "node10"]),  # no padding unless lo has it
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("node[008-10]", ["node008", "node009", "node010"]),
    ("node[5]", ["node5"]),
    ("a[1-2] b[3,5]\tc", ["a1", "a2", "b3", "b5", "c"]),  # Slurm also splits at white space
    ("x1,,x2,", ["x1", "x2"]),
    ("[1-2]", ["1", "2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ("localhost", ["localhost"]),
])
def test_slurm_hostlists_expand_as_slurm_does(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(("text", "why"), [
    ("node[3-1]", "the range 3-1 runs backwards"),
    ("node[1-2", r"a '\[' without its '\]'"),
    ("node1-2]", r"a '\]' without its '\['"),
    ("node[a-b]", "holds 'a-b', not a number or a range"),
    ("node[1,,2]", "holds '', not a number"),
    ("node[]", "holds '', not a number"),
    ("node[-3]", "holds '-3'"),
    ("n[[1]]", "brackets inside brackets"),
    ("node[0-70000]", "more than 65536 hosts"),
    ("", "no host in it"),
])
def test_bad_hostlists_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        expand_hostlist(text)


def _srun(node_id: int, nodes: str = "localhost,node2", job_id: str = "4242", **extra: str) -> dict[str, str]:
    """The variables srun gives one task of a 2-node, one-task-per-node step (srun -N2 --ntasks-per-node=1)."""
    return {"SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_NODELIST": nodes, "SLURM_NODELIST": nodes,
            "SLURM_NODEID": str(node_id), "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0",
            "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "1(x2)", **extra}


@pytest.mark.parametrize("node_id", [0, 1])
def test_under_srun_minus_n_is_enough(script: str, node_id: int) -> None:
    plan = parse_plan(["-n", "4", script], env=_srun(node_id))
    assert (plan.world_size, plan.nnodes, plan.node_rank, plan.base_rank) == (8, 2, node_id, 4 * node_id)
    assert plan.master_addr == "127.0.0.1"  # localhost, the first host, resolved
    assert plan.master_port == PORT_BASE + 4242 % PORT_SPAN == 19242
    assert [r.rank for r in plan.ranks] == [4 * node_id + i for i in range(4)]
    assert "SLURM: master localhost (127.0.0.1), the first host of SLURM_STEP_NODELIST" in plan.notes


def test_the_port_is_the_same_on_every_node_and_differs_between_jobs(script: str) -> None:
    ports = {parse_plan(["-n", "1", script], env=_srun(n, job_id=job)).master_port
             for n in (0, 1) for job in ("7",)}
    assert ports == {PORT_BASE + 7}
    assert parse_plan(["-n", "1", script], env=_srun(0, job_id="123456")).master_port == PORT_BASE + 3456
    assert all(PORT_BASE <= parse_plan(["-n", "1", script], env=_srun(0, job_id=str(j))).master_port < 32768
               for j in (0, 9999, 10**9 + 7))


def test_the_step_nodelist_wins_over_the_job_nodelist(script: str) -> None:
    # srun -N2 on part of a 4-node allocation: SLURM_JOB_NODELIST keeps the job's hosts
    env = _srun(0, SLURM_JOB_NODELIST="n[1-4]", SLURM_NNODES="2", SLURM_STEP_NODELIST="localhost,n4")
    assert parse_plan(["-n", "1", script], env=env).master_addr == "127.0.0.1"


@pytest.mark.parametrize(("argv", "env", "expected"), [
    # (world_size, node_rank, master_addr, master_port)
    (["--world_size", "6"], {}, (6, 1, "127.0.0.1", 19242)),
    (["--nnodes", "3"], {}, (6, 1, "127.0.0.1", 19242)),
    ([], {"WORLD_SIZE": "6"}, (6, 1, "127.0.0.1", 19242)),
    (["--node_rank", "0"], {}, (4, 0, "127.0.0.1", 19242)),
    ([], {"NODE_RANK": "0"}, (4, 0, "127.0.0.1", 19242)),
    ([], {"BASE_RANK": "0"}, (4, 0, "127.0.0.1", 19242)),
    (["--master_addr", "10.1.1.1"], {}, (4, 1, "10.1.1.1", 19242)),
    ([], {"MASTER_ADDR": "10.1.1.2", "MASTER_PORT": "2000"}, (4, 1, "10.1.1.2", 2000)),
    (["--master_port", "3000"], {"MASTER_PORT": "2000"}, (4, 1, "127.0.0.1", 3000)),
    (["--rdzv-endpoint", "10.1.1.3:4000", "--node-rank", "0"], {}, (4, 0, "10.1.1.3", 4000)),
    ([], {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "10.1.1.4"}, (6, 2, "10.1.1.4", 19242)),
])
def test_flags_and_the_usual_variables_win_over_slurm(script, argv, env, expected) -> None:
    plan = parse_plan(["-n", "2", *argv, script], env={**_srun(1), **env})
    assert (plan.world_size, plan.node_rank, plan.master_addr, plan.master_port) == expected


def test_a_node_id_outside_the_step_names_slurm_nodeid(script: str) -> None:
    with pytest.raises(LaunchError) as info:
        parse_plan(["-n", "2", script], env=_srun(3))
    assert str(info.value).startswith("env SLURM_NODEID is 3, but the job has 2 node(s) (world_size 4, -n 2)")


def test_a_single_node_run_ignores_slurms_node_and_master(script: str) -> None:
    # --nnodes 1 (or --standalone) on one node of a bigger job: no SLURM rank, no SLURM port
    for extra in (["--nnodes", "1"], ["--standalone"], ["--world_size", "2"]):
        plan = parse_plan(["-n", "2", *extra, script], env=_srun(1))
        assert (plan.world_size, plan.node_rank, plan.master_port) == (2, 0, None)
    one = {**_srun(0, nodes="localhost"), "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1",
           "SLURM_STEP_NUM_TASKS": "1"}
    plan = parse_plan(["-n", "2", script], env=one)
    assert (plan.world_size, plan.master_addr, plan.master_port) == (2, "127.0.0.1", None)
    assert parse_plan(["-n", "2", script], env={"SLURM_JOB_ID": "5"}).world_size == 2  # salloc's shell


@pytest.mark.parametrize(("env", "message"), [
    # the batch script of a 2-node job runs on the first node only
    ({"SLURM_STEP_NUM_NODES": "", "SLURM_STEP_NUM_TASKS": "", "SLURM_STEP_NODELIST": ""},
     r"SLURM allocated 2 nodes, but this lockstep was not started by srun: start one per node with "
     r"`srun --ntasks-per-node=1 lockstep ...`, or pass --nnodes 1 to use this node only"),
    ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16"},
     r"srun started 16 tasks on 2 node\(s\), and each would start its own ranks: run one lockstep per node "
     r"\(srun --ntasks-per-node=1\)"),
    ({"SLURM_STEP_NODELIST": "n[1-3]"}, "env SLURM_STEP_NUM_NODES says 2 nodes but SLURM_STEP_NODELIST names 3"),
    ({"SLURM_STEP_NODELIST": "n[2-1]"},
     r"env SLURM_STEP_NODELIST 'n\[2-1\]' is not a Slurm hostlist \(the range 2-1 runs backwards\)"),
    ({"SLURM_JOB_ID": "12a"}, "env SLURM_JOB_ID: expected a number, got '12a'"),
    ({"SLURM_STEP_NODELIST": "no-such-host.invalid,n2"},
     r"the master host 'no-such-host.invalid' \(the first host of SLURM_STEP_NODELIST\) does not resolve"),
])
def test_slurm_variables_that_cannot_work_are_one_line_errors(script: str, env, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_plan(["-n", "2", script], env={**_srun(1), **env})


def test_kubernetes_pytorchjob_variables(script: str) -> None:
    # What Kubeflow's training operator gives worker pod 1 of a 3-pod PyTorchJob with nprocPerNode 2:
    # WORLD_SIZE counts processes and RANK is the pod's index, both for scripts run without a launcher.
    pod = {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "6", "RANK": "1"}
    plan = parse_plan([script], env=pod)
    assert (plan.nproc, plan.world_size, plan.nnodes, plan.node_rank, plan.base_rank) == (2, 6, 3, 1, 2)
    assert (plan.master_addr, plan.master_port) == ("job-master-0", 23456)
    # without nprocPerNode the operator counts one process per pod; -n decides
    plan = parse_plan(["-n", "4", script], env={**pod, "PET_NPROC_PER_NODE": "", "WORLD_SIZE": "3"})
    assert (plan.world_size, plan.node_rank, plan.base_rank) == (12, 1, 4)
    worker = plan.worker_env(1, 23456, 0, dict(pod))
    assert (worker["RANK"], worker["WORLD_SIZE"], worker["NODE_RANK"]) == ("5", "12", "1")
    # an elasticPolicy job: torchrun's c10d rendezvous numbers the nodes, which lockstep does not
    elastic = {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_NPROC_PER_NODE": "2"}
    for nnodes in ("2:4", "2:2"):
        with pytest.raises(LaunchError, match="--rdzv-backend c10d needs --node-rank on each node"):
            parse_plan([script], env={**elastic, "PET_NNODES": nnodes})


JOB = Path(__file__).resolve().parents[1] / "checkpoint" / "train_job.py"


def _job_id_with_a_free_port() -> str:
    """A SLURM_JOB_ID whose derived port nothing on this machine listens on."""
    for job_id in random.Random(os.getpid()).sample(range(PORT_SPAN), 200):
        with socket.socket() as s:
            try:
                s.bind(("", PORT_BASE + job_id))
            except OSError:
                continue
        return str(job_id + PORT_SPAN * 3)
    raise RuntimeError("no free port in the SLURM range")


def _clean_env() -> dict[str, str]:
    """The test's environment without any rank, SLURM or torchrun variable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "NODE_RANK", "BASE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
           and not k.startswith(("SLURM_", "PET_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _train_args(tmp: Path, name: str) -> list[str]:
    return [str(JOB), "--batches", "6", "--save-interval", "3ba", "--folder", str(tmp / f"ckpt-{name}"),
            "--out", str(tmp / f"{name}.pt")]


@pytest.fixture(scope="module")
def one_node_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The parameters after training the job on one node with 2 ranks."""
    def make(tmp: Path) -> dict[str, torch.Tensor]:
        tmp.mkdir()
        one = subprocess.run([sys.executable, "-m", "lockstep", "-n", "2", *_train_args(tmp, "one_node")], cwd=tmp,
                             env=_clean_env(), capture_output=True, text=True, timeout=200)
        assert one.returncode == 0, one.stderr
        return torch.load(tmp / "one_node.pt")
    return shared_run(tmp_path_factory, "one-node-weights", make)


def _assert_same(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


@pytest.mark.timeout(240)
def test_two_srun_tasks_train_as_one_job_with_only_minus_n(tmp_path: Path, one_node_weights) -> None:
    """Two launchers with the variables srun gives two nodes' tasks (the master named `localhost`)
    train to completion with `-n 1` alone, and end with the parameters of one node running 2 ranks."""
    job_id = _job_id_with_a_free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "1", "-v",
                               *_train_args(tmp_path, f"node{n}")],
                              cwd=tmp_path, env={**_clean_env(), **_srun(n, job_id=job_id)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    outs = [n.communicate(timeout=200) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    port = PORT_BASE + int(job_id) % PORT_SPAN
    for n, (_, err) in enumerate(outs):
        assert "lockstep: SLURM: 2 node(s) x 1 ranks" in err
        assert f"lockstep: SLURM: this is node {n} (SLURM_NODEID)" in err
        assert "lockstep: SLURM: master localhost (127.0.0.1), the first host of SLURM_STEP_NODELIST" in err
        assert f"lockstep: SLURM: master port {port}, from SLURM_JOB_ID" in err
    _assert_same(torch.load(tmp_path / "node0.pt"), one_node_weights)  # global rank 0 saves


@pytest.fixture
def hosts():
    netns = pytest.importorskip("tests.launcher.netns", reason="namespace hosts (tests/launcher/netns.py) are not here")
    yield from netns.make_hosts(2)


@pytest.mark.timeout(240)
def test_srun_on_two_hosts_that_resolve_the_nodelist_with_their_own_hosts_files(
        hosts, tmp_path: Path, one_node_weights) -> None:
    """Two network-namespace hosts, each with its own /etc/hosts (``ip netns exec`` mounts
    /etc/netns/<namespace>/hosts there) naming both nodes, which resolve nowhere else: srun's
    variables with SLURM_JOB_NODELIST in Slurm's syntax are all each launcher needs."""
    prefix = f"lst{hosts.x}node"
    table = "127.0.0.1 localhost\n" + "".join(f"{hosts.address(i)} {prefix}{i + 1:02d}\n" for i in range(2))
    folders = [Path("/etc/netns") / hosts.name(i) for i in range(2)]
    try:
        for folder in folders:
            folder.mkdir(parents=True)
            (folder / "hosts").write_text(table)
        with pytest.raises(LaunchError, match="does not resolve"):  # not from the tests' namespace
            parse_plan(["-n", "1", str(JOB)], env=_srun(1, nodes=f"{prefix}[01-02]"))
        job_id = _job_id_with_a_free_port()
        # The ranks' interface is named so that this test checks SLURM's part alone (where it is
        # unset the launcher picks the one that routes to the master: test_hosts.py).
        env = {**_clean_env(), "GLOO_SOCKET_IFNAME": hosts.interface(0)}
        nodes = [hosts.popen(n, [sys.executable, "-m", "lockstep", "-n", "1", "-v", *_train_args(tmp_path, f"node{n}")],
                             cwd=tmp_path, env={**env, **_srun(n, nodes=f"{prefix}[01-02]", job_id=job_id)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for n in (0, 1)]
        outs = [n.communicate(timeout=200) for n in nodes]
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only if no one else keeps files there
    assert [n.returncode for n in nodes] == [0, 0], outs
    for _, err in outs:
        assert f"lockstep: SLURM: master {prefix}01 ({hosts.address(0)}), the first host of SLURM_STEP_NODELIST" in err
    _assert_same(torch.load(tmp_path / "node0.pt"), one_node_weights)
