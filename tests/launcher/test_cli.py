"""argv + env -> LaunchPlan: every rule, without starting a process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.launcher.cli import parse_plan
from lockstep.launcher.plan import LaunchError, Mode


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_defaults_single_node(script: str) -> None:
    plan = parse_plan(["-n", "2", script, "--lr", "3"], env={})
    assert (plan.nproc, plan.world_size, plan.base_rank, plan.node_rank) == (2, 2, 0, 0)
    assert plan.master_addr == "127.0.0.1" and plan.master_port is None
    assert plan.target_args == ("--lr", "3") and plan.mode is Mode.SCRIPT
    assert str(plan.run_directory).startswith("runs/")


def test_nproc_from_env_and_flag_overrides_env(script: str) -> None:
    assert parse_plan([script], env={"LOCAL_WORLD_SIZE": "3"}).nproc == 3
    assert parse_plan(["-n", "2", script], env={"LOCAL_WORLD_SIZE": "3"}).nproc == 2
    assert parse_plan([script], env={"CUDA_VISIBLE_DEVICES": ""}).nproc == 1
    assert parse_plan([script], env={"CUDA_VISIBLE_DEVICES": "0,1,2"}).nproc == 3


def test_script_args_that_look_like_launcher_flags_go_to_the_script(script: str) -> None:
    plan = parse_plan(["-n", "1", script, "-n", "5", "--master_port", "x"], env={})
    assert plan.nproc == 1 and plan.target_args == ("-n", "5", "--master_port", "x")


@pytest.mark.parametrize(
    ("argv", "env", "base_rank", "node_rank"),
    [
        (["--world_size", "4", "--node_rank", "1"], {}, 2, 1),
        (["--world_size", "4", "--base_rank", "2"], {}, 2, 1),
        (["--world_size", "5", "--base_rank", "3", "--node_rank", "1"], {}, 3, 1),
        ([], {"WORLD_SIZE": "4", "NODE_RANK": "1"}, 2, 1),
        (["--node_rank", "0"], {"WORLD_SIZE": "4", "NODE_RANK": "1"}, 0, 0),
    ],
)
def test_multinode_rank_inference(script, argv, env, base_rank, node_rank) -> None:
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", **env}
    plan = parse_plan(["-n", "2", *argv, script], env=env)
    assert (plan.base_rank, plan.node_rank) == (base_rank, node_rank)
    assert plan.is_multinode and plan.master_addr == "10.0.0.1" and plan.master_port == 29500
    assert [r.rank for r in plan.ranks] == [base_rank, base_rank + 1]


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["-n", "0"], {}, "-n/--nproc: expected a positive integer, got '0'"),
        (["-n", "two"], {}, "got 'two'"),
        (["-m", "-c"], {}, "not allowed with"),
        (["-n", "2", "--world_size", "3", "--node_rank", "1"], {"MASTER_ADDR": "a", "MASTER_PORT": "1"}, "do not fit in world_size 3"),
        (["-n", "2", "--world_size", "4"], {"MASTER_ADDR": "a", "MASTER_PORT": "1"}, "needs --node_rank or --base_rank"),
        (["-n", "2", "--world_size", "4", "--base_rank", "1"], {"MASTER_ADDR": "a", "MASTER_PORT": "1"}, "not a multiple of nproc"),
        (["-n", "2", "--world_size", "4", "--node_rank", "1"], {"MASTER_PORT": "1"}, "needs --master_addr"),
        (["-n", "2", "--world_size", "4", "--node_rank", "1"], {"MASTER_ADDR": "a"}, "needs --master_port"),
        (["-n", "2", "--world_size", "1"], {}, "smaller than nproc"),
        (["-n", "2", "--node_rank", "1"], {}, "single-node run"),
        (["--master_port", "70000"], {}, "port number 1-65535"),
        ([], {"WORLD_SIZE": "zero"}, "env WORLD_SIZE"),
        (["--stdout", "out_{rnk}.txt"], {}, "--stdout 'out_{rnk}.txt' is not a valid format"),
        (["--max_restarts", "-1"], {}, "--max_restarts"),
    ],
)
def test_usage_errors(script, argv, env, needle) -> None:
    with pytest.raises(LaunchError) as info:
        parse_plan([*argv, script], env=env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_targets(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="training script 'nope.py' does not exist"):
        parse_plan(["nope.py"], env={})
    with pytest.raises(LaunchError, match="module 'no_such_module_xyz' was not found"):
        parse_plan(["-m", "no_such_module_xyz"], env={})
    with pytest.raises(LaunchError, match="command 'no-such-command-xyz' was not found"):
        parse_plan(["-c", "no-such-command-xyz"], env={})
    with pytest.raises(LaunchError, match="no training script given"):
        parse_plan([], env={})


def test_log_paths_use_every_format_field(script: str, tmp_path: Path) -> None:
    fmt = str(tmp_path / "{rank}-{local_rank}-{world_size}-{node_rank}-{local_world_size}.out")
    plan = parse_plan(["-n", "2", "--world_size", "4", "--node_rank", "1", "--master_addr", "h",
                       "--master_port", "5", "--stdout", fmt, script], env={})
    first, second = plan.ranks
    assert first.stdout_path is None and first.stderr_path is None  # local rank 0: the console
    assert second.stdout_path == tmp_path / "3-1-4-1-2.out"
    assert second.stderr_path == plan.run_directory / "rank3.stderr.log"


def test_worker_env_contract(script: str) -> None:
    plan = parse_plan(["-n", "2", "--world_size", "4", "--node_rank", "1", "--master_addr", "h",
                       "--master_port", "5", script], env={})
    env = plan.worker_env(1, 5, restart_count=2, base_env={"KEEP": "1"})
    expected = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "NODE_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "5", "PYTHONUNBUFFERED": "1",
                "LOCKSTEP_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", "KEEP": "1"}
    assert expected.items() <= env.items()
    assert int(env["OMP_NUM_THREADS"]) >= 1
    assert plan.worker_env(0, 5, 0, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


def test_commands_per_mode(script: str) -> None:
    assert parse_plan([script, "a"], env={}).command()[-4:] == ["lockstep.launcher.worker", "script", script, "a"]
    assert parse_plan(["-m", "json.tool", "x"], env={}).command()[-3:] == ["module", "json.tool", "x"]
    assert parse_plan(["-c", "true", "x"], env={}).command() == ["true", "x"]


def test_cli_usage_error_is_one_line_exit_2(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "lockstep", "-n", "0", "x.py"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_version_and_help() -> None:
    out = subprocess.run([sys.executable, "-m", "lockstep", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("lockstep ")
    out = subprocess.run([sys.executable, "-m", "lockstep", "--help"], capture_output=True, text=True, timeout=60)
    for flag in ("--nproc", "--stdout", "--stderr", "--verbose", "--module_mode", "--command_mode",
                 "--world_size", "--base_rank", "--node_rank", "--master_addr", "--master_port",
                 "--run_directory", "--max_restarts"):
        assert flag in out.stdout
