"""argv + env -> LaunchPlan: every rule, without starting a process."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lockstep.launcher.cli import main, parse_plan
from lockstep.launcher.plan import LaunchError, Mode, Stream


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
    # ... with a note, always printed, since that is rarely what was meant
    assert plan.advice == (f"the launcher's flags after {script} (-n --master_port) go to the script, not to the "
                           f"launcher: put them before the script (lockstep -n --master_port ... {script})",)
    assert parse_plan([script, "--lr", "3", "-v", "--help"], env={}).advice == ()  # a script's own flags


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


def test_a_directory_given_as_the_script_says_so_and_what_to_pass(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    with pytest.raises(LaunchError) as info:
        parse_plan(["-n", "2", str(folder)], env={})
    message = str(info.value)
    assert f"training script '{folder}' is a directory" in message and "\n" not in message
    assert f"pass the script to run, e.g. {folder / 'train.py'}" in message
    # as `python FOLDER` does, a folder with a __main__.py runs it
    (folder / "__main__.py").write_text("print('main')\n")
    assert parse_plan(["-n", "2", str(folder)], env={}).target == str(folder)


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
                "LOCKSTEP_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", "KEEP": "1",
                "TORCHELASTIC_RUN_ID": plan.run_directory.name, "TORCHELASTIC_RESTART_COUNT": "2",
                "TORCHELASTIC_MAX_RESTARTS": "0", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                "ROLE_NAME": "default", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4",
                "TORCHELASTIC_ERROR_FILE": str((plan.run_directory / "rank3.error.json").absolute())}
    assert expected.items() <= env.items()
    share = str(max(1, (os.cpu_count() or 1) // 2))  # each of the node's 2 ranks: its share of the cores
    assert env["OMP_NUM_THREADS"] == env["TORCHINDUCTOR_COMPILE_THREADS"] == share
    assert plan.worker_env(0, 5, 0, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    assert plan.worker_env(0, 5, 0, {"TORCHINDUCTOR_COMPILE_THREADS": "3"})["TORCHINDUCTOR_COMPILE_THREADS"] == "3"
    assert plan.worker_env(1, 5, 2, {}, restarts_used=1)["TORCHELASTIC_RESTART_COUNT"] == "1"
    # As torchrun's agent: on unless the user set it, in which case theirs is kept (even empty).
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    for users in ("0", "3", ""):
        user_env = plan.worker_env(0, 5, 0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": users})
        assert user_env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == users


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


# -- torchrun's command line -------------------------------------------------------------------

@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--nproc-per-node", "2"], {}, {"nproc": 2, "world_size": 2}),
        (["--nproc_per_node", "3"], {}, {"nproc": 3}),
        (["--nnodes", "1", "--nproc-per-node", "2", "--standalone"], {}, {"nproc": 2, "world_size": 2, "nnodes": 1}),
        (["--nnodes", "2:2", "--nproc-per-node", "2", "--node-rank", "1", "--master-addr", "h",
          "--master-port", "5"], {}, {"world_size": 4, "base_rank": 2, "node_rank": 1, "master_addr": "h",
                                       "master_port": 5, "nnodes": 2, "group_world_size": 2}),
        (["--nnodes", "2", "-n", "2", "--node_rank", "1", "--rdzv-endpoint", "h:29600"], {},
         {"master_addr": "h", "master_port": 29600}),
        (["--nnodes", "2", "-n", "2", "--node_rank", "1", "--rdzv_endpoint", "h"], {},
         {"master_addr": "h", "master_port": 29400}),
        (["--nnodes", "2", "-n", "2", "--node_rank", "1", "--rdzv-endpoint", "[::1]:7"], {},
         {"master_addr": "::1", "master_port": 7}),
        (["--rdzv-backend", "c10d", "--rdzv_backend", "static", "--rdzv-id", "job"], {}, {"run_id": "job"}),
        (["--log-dir", "logs"], {}, {"run_directory": Path("logs")}),
        (["--log_dir", "logs"], {}, {"run_directory": Path("logs")}),
        (["--max-restarts", "2"], {}, {"max_restarts": 2}),
        (["--shutdown-timeout", "7"], {}, {"grace_period": 7.0}),
        (["--rdzv-conf", "join_timeout=12"], {}, {"rdzv_timeout": 12.0, "rdzv_last_call": 30.0}),
        (["--rdzv-conf", "join_timeout=12,last_call_timeout=3"], {}, {"rdzv_timeout": 12.0, "rdzv_last_call": 3.0}),
        (["--rdzv_last_call", "7", "--rdzv-conf", "last_call_timeout=3"], {}, {"rdzv_last_call": 7.0}),
        (["--rdzv_timeout", "3"], {"LOCKSTEP_RDZV_TIMEOUT": "9"}, {"rdzv_timeout": 3.0}),
        ([], {"LOCKSTEP_RDZV_TIMEOUT": "9"}, {"rdzv_timeout": 9.0}),
        ([], {}, {"rdzv_timeout": 300.0, "tee": Stream.NONE, "redirects": Stream.NONE, "role": "default"}),
        (["--tee", "3"], {}, {"tee": Stream.BOTH}),
        (["-t", "1", "-r", "2"], {}, {"tee": Stream.STDOUT, "redirects": Stream.STDERR}),
        (["--monitor-interval", "0.1", "--start-method", "fork", "--event-log-handler", "null",
          "--role", "worker"], {}, {"role": "worker"}),
        # torchrun takes any float; lockstep ignores it, 0 included
        (["--monitor-interval", "0"], {}, {"nproc": 1}),
        (["--monitor_interval", "0"], {}, {"nproc": 1}),
        (["--monitor_interval=2.5", "--start_method", "spawn", "--event_log_handler", "null"], {}, {"nproc": 1}),
        # --standalone: one node with a port lockstep picks; rank variables in the env do not apply
        (["--standalone", "-n", "2"], {"WORLD_SIZE": "8", "NODE_RANK": "3", "MASTER_PORT": "1234",
                                        "MASTER_ADDR": "10.1.1.1"},
         {"world_size": 2, "node_rank": 0, "master_port": None, "master_addr": "localhost"}),
        # HOST:0: a free port the launcher picks (on one node), whatever MASTER_PORT says
        (["--rdzv-endpoint", "localhost:0"], {"MASTER_PORT": "1234"},
         {"master_addr": "localhost", "master_port": None}),
        # per-local-rank maps, as torchrun's Std.from_str reads them
        (["-n", "3", "--tee", "0:3,2:1", "-r", "1:2"], {},
         {"tee": {0: Stream.BOTH, 2: Stream.STDOUT}, "redirects": {1: Stream.STDERR}}),
    ],
)
def test_torchrun_flags(script, argv, env, expected) -> None:
    plan = parse_plan([*argv, script], env=env)
    assert {k: getattr(plan, k) for k in expected} == expected


def test_torchrun_modes() -> None:
    assert parse_plan(["--no-python", "true"], env={}).mode is Mode.COMMAND
    assert parse_plan(["--no_python", "true"], env={}).command() == ["true"]
    assert parse_plan(["--module", "json.tool"], env={}).mode is Mode.MODULE


def test_torchrun_nproc_words(script) -> None:
    cores = os.cpu_count()
    assert parse_plan(["--nproc-per-node", "cpu", script], env={"CUDA_VISIBLE_DEVICES": "0"}).nproc == cores
    assert parse_plan(["--nproc-per-node", "auto", script], env={"CUDA_VISIBLE_DEVICES": "0,1"}).nproc == 2
    assert parse_plan(["--nproc-per-node", "auto", script], env={"CUDA_VISIBLE_DEVICES": ""}).nproc == cores
    assert parse_plan(["--nproc-per-node", "gpu", script], env={"CUDA_VISIBLE_DEVICES": "3"}).nproc == 1


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--nnodes", "4:1"], {}, "--nnodes 4:1: MIN is more than MAX: give MIN:MAX with MIN <= MAX"),
        (["--nnodes", "x"], {}, "--nnodes: expected N or MIN:MAX"),
        (["--nnodes", "1:2", "--min_ranks", "1", "--node-rank", "0"], {"MASTER_ADDR": "a", "MASTER_PORT": "1"},
         "--nnodes 1:2 and --min_ranks 1 both set how few ranks the job goes on with: give one of them"),
        (["--nnodes", "1", "-n", "2", "--world_size", "3"], {}, "is not --nnodes 1 x nproc 2"),
        (["--nnodes", "2", "-n", "2"], {"MASTER_ADDR": "a", "MASTER_PORT": "1"},
         "a 2-node run needs --node-rank on each node: lockstep's rendezvous is static"),
        (["--monitor-interval", "-1"], {}, "--monitor-interval/--monitor_interval: expected seconds >= 0, got '-1'"),
        (["--monitor_interval", "-0.5"], {}, "expected seconds >= 0, got '-0.5'"),
        (["--monitor_interval", "nan"], {}, "expected seconds >= 0, got 'nan'"),
        (["--standalone", "--nnodes", "2", "--node-rank", "1"], {}, "--standalone runs one node"),
        (["--rdzv-backend", "etcd"], {}, "--rdzv-backend etcd: not supported"),
        (["--rdzv-endpoint", "h:99999"], {}, "the port must be a number 0-65535"),
        (["--rdzv-endpoint", "h:0", "--nnodes", "2", "--node-rank", "1"], {},
         "--rdzv-endpoint h:0: port 0 picks a free port, which works on one node only"),
        (["--log-dir", "a", "--run_directory", "b"], {}, "--log-dir a and --run_directory b name two folders"),
        (["--rdzv-endpoint", "a:1", "--master_addr", "b"], {}, "disagrees with --master_addr"),
        (["--rdzv-conf", "read_timeout=3"], {}, "--rdzv-conf 'read_timeout' is not supported"),
        (["--rdzv-conf", "join_timeout=inf"], {}, "join_timeout: expected seconds > 0"),
        (["--rdzv-conf", "last_call_timeout=0"], {}, "last_call_timeout: expected seconds > 0"),
        (["--rdzv_last_call", "-1"], {}, "--rdzv_last_call/--rdzv-last-call: expected seconds > 0"),
        (["--nproc-per-node", "xpu"], {}, "counts CUDA devices only"),
        (["--nproc-per-node", "gpu"], {"CUDA_VISIBLE_DEVICES": ""}, "no CUDA device is visible"),
        (["--nproc-per-node", "many"], {}, "one of auto, cpu, gpu, xpu"),
        (["--tee", "0:1,1:2"], {}, "--tee 0:1,1:2: local ranks are 0..0"),
        (["--redirects", "0:1,1"], {}, "or one per local rank like 0:3,1:1, got '0:1,1'"),
        (["--tee", "0:4"], {}, "got '0:4'"),
        (["--tee", "5"], {}, "expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (["--redirects", "x"], {}, "--redirects: expected 0 (none)"),
        (["--local-ranks-filter", "0"], {}, "add --tee 3"),
        (["--tee", "3", "-n", "2", "--local-ranks-filter", "2"], {}, "local ranks are 0..1"),
        (["--event-log-handler", "console"], {}, "only null"),
        (["--start-method", "thread"], {}, "invalid choice"),
        (["--run-path"], {}, "--run-path: lockstep starts every rank in a fresh interpreter"),
        (["--run_path"], {}, "--run_path: lockstep starts"),
        (["--local-addr", "x"], {}, "--local-addr: ranks reach the master at --master_addr"),
        (["--logs-specs", "x"], {}, "--stdout/--stderr"),
        (["--numa-binding", "node"], {}, "NUMA binding is not supported"),
        (["--signals-to-handle", "SIGUSR1"], {}, "forwards SIGINT and SIGTERM"),
        (["--virtual-local-rank"], {}, "LOCAL_RANK"),
        (["--duplicate-stdout-filters", "a"], {}, "duplicate filters are not supported"),
        (["--module", "--no-python"], {}, "not allowed with"),
    ],
)
def test_torchrun_usage_errors(script, argv, env, needle) -> None:
    with pytest.raises(LaunchError) as info:
        parse_plan([*argv, script], env=env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host1:29400"], {},
         "--rdzv-backend c10d needs --node-rank on each node: lockstep's rendezvous is static and does not "
         "number the nodes as torchrun's c10d backend does; pass --node-rank R (0 on host1, the host of "
         "--rdzv-endpoint; 1 on the other node)"),
        (["--nnodes=4", "--rdzv_backend=c10d", "--rdzv_endpoint=[fe80::1]"], {},
         "(0 on fe80::1, the host of --rdzv-endpoint; 1..3 on the others, one each)"),
        (["--nnodes", "2", "--rdzv-endpoint", "host1"], {}, "a 2-node run needs --node-rank on each node"),
        (["--nnodes", "2", "--master-addr", "a", "--master-port", "1"], {}, "(0 on the --master-addr host; 1 on"),
        (["--world_size", "2", "--rdzv-backend", "static"], {"MASTER_ADDR": "a", "MASTER_PORT": "1"},
         "--rdzv-backend static needs --node-rank on each node"),
    ],
)
def test_torchrun_multinode_line_without_node_rank_names_the_static_way(script, argv, env, needle) -> None:
    with pytest.raises(LaunchError) as info:
        parse_plan([*argv, script], env=env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ranks", [["--node-rank", "1"], ["--node_rank", "1"], ["--base_rank", "1"]])
def test_torchrun_c10d_line_with_a_node_rank_runs(script, ranks) -> None:
    plan = parse_plan(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host1:29400", *ranks,
                       script], env={})
    assert (plan.world_size, plan.node_rank, plan.master_addr, plan.master_port) == (2, 1, "host1", 29400)
    # The node rank may come from the environment too, as with any multi-node run.
    plan = parse_plan(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host1", script],
                      env={"NODE_RANK": "1"})
    assert plan.node_rank == 1


def test_c10d_line_without_node_rank_is_one_line_exit_2(script, capsys) -> None:
    code = main(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host1:29400", script])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("lockstep: error: --rdzv-backend c10d needs --node-rank") and err.count("\n") == 1


def test_every_torchrun_spelling_is_known_to_lockstep() -> None:
    from torch.distributed.run import get_args_parser

    from lockstep.launcher.cli import build_parser

    known = set(build_parser()._option_string_actions)
    torchruns = {flag for action in get_args_parser()._actions for flag in action.option_strings}
    assert torchruns - known == set()


def test_every_torchrun_flag_is_accepted_or_refused_with_a_reason(script) -> None:
    from torch.distributed.run import get_args_parser

    known = {"--nproc-per-node": "2", "--nproc_per_node": "2", "--nnodes": "1", "--start-method": "spawn",
             "--start_method": "spawn", "--numa-binding": "node", "--numa_binding": "node",
             "-t": "1", "--tee": "1", "-r": "1", "--redirects": "1", "--rdzv-backend": "c10d",
             "--rdzv_backend": "c10d", "--event-log-handler": "null", "--event_log_handler": "null",
             "--rdzv-conf": "join_timeout=5", "--rdzv_conf": "join_timeout=5",
             "--local-ranks-filter": "0", "--local_ranks_filter": "0", "--node-rank": "0",
             "--node_rank": "0", "--master-port": "29500", "--master_port": "29500",
             "--max-restarts": "1", "--max_restarts": "1", "--monitor-interval": "1",
             "--monitor_interval": "1", "--shutdown-timeout": "3", "--shutdown_timeout": "3",
             "--rdzv-endpoint": "127.0.0.1:29400", "--rdzv_endpoint": "127.0.0.1:29400"}
    for action in get_args_parser()._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help"):
                continue
            argv = [flag] if action.nargs == 0 else [flag, known.get(flag, "x")]
            if flag in ("--local-ranks-filter", "--local_ranks_filter"):
                argv += ["--tee", "3"]
            target = {"-m": "json.tool", "--module": "json.tool", "--no-python": "true",
                      "--no_python": "true"}.get(flag, script)
            try:
                parse_plan([*argv, target], env={})
            except LaunchError as e:  # refused: the message starts with the flag and says why
                assert str(e).startswith(flag + ":"), (flag, str(e))


def test_tee_and_redirects_decide_where_each_stream_goes(script) -> None:
    plain = parse_plan(["-n", "2", script], env={}).ranks
    assert plain[0].stdout_path is None and plain[0].tee == Stream.NONE
    teed = parse_plan(["-n", "2", "--tee", "3", script], env={}).ranks
    assert all(r.tee == Stream.BOTH and r.stdout_path and r.stderr_path for r in teed)
    out_only = parse_plan(["-n", "2", "-r", "1", script], env={}).ranks[0]
    assert out_only.stdout_path is not None and out_only.stderr_path is None and out_only.tee == Stream.NONE
    filtered = parse_plan(["-n", "2", "--tee", "2", "--local-ranks-filter", "1", script], env={}).ranks
    assert filtered[0].tee == Stream.NONE and filtered[0].stderr_path is not None  # to its file only
    assert filtered[1].tee == Stream.STDERR


# -- bad input: one line naming the argument and the fix, before anything starts ---------------

@pytest.mark.parametrize("value", ["inf", "nan", "1e308", "0", "-1", "-inf", "86401"])
def test_grace_period_must_be_finite_positive_and_sane(script, value) -> None:
    with pytest.raises(LaunchError, match="--grace_period: expected seconds > 0 and at most 86400"):
        parse_plan([f"--grace_period={value}", script], env={})


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_rdzv_timeout_must_be_finite_and_positive(script, value) -> None:
    with pytest.raises(LaunchError, match="expected seconds > 0"):
        parse_plan(["--rdzv_timeout", value, script], env={})
    with pytest.raises(LaunchError, match="env LOCKSTEP_RDZV_TIMEOUT"):
        parse_plan([script], env={"LOCKSTEP_RDZV_TIMEOUT": value})


def test_run_directory_and_log_paths_must_be_writable(script, tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["--run_directory", str(a_file)], f"--run_directory '{a_file}' is a file, not a folder: pass a folder"),
        (["--run_directory", str(a_file / "sub")], f"is under '{a_file}', which is a file"),
        (["-n", "2", "--stdout", str(a_file / "{rank}.out")], "--stdout: rank 1's log file"),
        (["-n", "2", "--stderr", str(tmp_path)], f"--stderr: rank 1's log file '{tmp_path}' is a folder"),
    ]
    for argv, needle in cases:
        with pytest.raises(LaunchError) as info:
            parse_plan([*argv, script], env={})
        assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_run_directory_without_write_permission(script, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(LaunchError, match="is not writable"):
        parse_plan(["--run_directory", str(locked / "run"), script], env={})


def test_binary_or_non_utf8_training_script_is_refused(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(2000))
    with pytest.raises(LaunchError, match="is a binary file, not Python source: run a program with -c/--no-python"):
        parse_plan([str(binary)], env={})
    latin = tmp_path / "latin.py"
    latin.write_bytes("print('caf\u00e9')\n".encode("latin-1"))
    with pytest.raises(LaunchError, match=r"is not UTF-8 text \(byte 0xe9 at offset 10\)"):
        parse_plan([str(latin)], env={})
    declared = tmp_path / "declared.py"
    declared.write_bytes("# -*- coding: latin-1 -*-\nprint('caf\u00e9')\n".encode("latin-1"))
    assert parse_plan([str(declared)], env={}).target == str(declared)
    cut = tmp_path / "cut.py"  # a multi-byte character across the 1 KiB boundary is fine
    cut.write_bytes(b"#" * 1023 + "\u00e9\n".encode())
    assert parse_plan([str(cut)], env={}).target == str(cut)
    app = tmp_path / "app.zip"
    with zipfile.ZipFile(app, "w") as z:
        z.writestr("__main__.py", "print('zip app')\n")
    assert parse_plan([str(app)], env={}).target == str(app)
    assert parse_plan(["-c", "true"], env={}).mode is Mode.COMMAND  # commands are not read


def test_torchrun_pet_variables_stand_for_their_flags_and_flags_win(script: str) -> None:
    env = {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "2", "PET_RDZV_ID": "job7", "PET_STANDALONE": "1",
           "PET_NNODES": "1", "WORLD_SIZE": "8"}
    plan = parse_plan([script], env=env)
    assert (plan.nproc, plan.max_restarts, plan.run_id, plan.world_size) == (3, 2, "job7", 3)  # standalone
    assert parse_plan(["--nproc-per-node", "1", script], env=env).nproc == 1
    assert parse_plan([script], env={"PET_STANDALONE": "0", "PET_NPROC_PER_NODE": "2"}).world_size == 2
    with pytest.raises(LaunchError, match="--run-path: lockstep starts every rank in a fresh interpreter"):
        parse_plan([script], env={"PET_RUN_PATH": "1"})


@pytest.mark.parametrize(("endpoint", "host", "port"), [
    ("tcp://10.0.0.1:29500", "10.0.0.1", 29500),  # as in init_method URLs: the scheme is dropped
    ("TCP://node-1", "node-1", 29400),
    ("tcp://[fd00::1]:7", "fd00::1", 7),
    ("[fe80::1]", "fe80::1", 29400),
    (" h:5 ", "h", 5),
    ("my_service.local:6", "my_service.local", 6),
])
def test_rdzv_endpoint_forms(script, endpoint, host, port) -> None:
    plan = parse_plan(["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint, script], env={})
    assert (plan.master_addr, plan.master_port) == (host, port)


@pytest.mark.parametrize(("endpoint", "why"), [
    ("::::", "too many ':'"),
    ("a:b:c", "too many ':'"),
    ("::1", "an IPv6 address goes in brackets, [::1]:PORT"),
    ("fe80::1:29400", "an IPv6 address goes in brackets, [fe80::1]:29400"),
    ("http://h:1", "only tcp:// may come before the host, not http://"),
    ("tcp://", "no host"),
    (":5", "no host"),
    ("", "no host"),
    ("h:", "the port must be a number 0-65535"),
    ("h:x", "the port must be a number 0-65535"),
    ("[::1", "brackets hold an IPv6 address, with :PORT after them"),
    ("[h]:1", "brackets hold an IPv6 address, with :PORT after them"),
    ("[::1]5", "brackets hold an IPv6 address, with :PORT after them"),
    ("tcp://h:1/", "the port must be a number 0-65535"),
    ("h/x:1", "'h/x' is not a host name or an IPv4 address"),
])
def test_a_malformed_rdzv_endpoint_is_a_usage_error_not_a_host_to_wait_for(script, endpoint, why) -> None:
    """Each was read as a host name on port 29400 and waited for until --rdzv_timeout (issue 49)."""
    for argv, env, source in ((["--rdzv-endpoint", endpoint], {}, "--rdzv-endpoint"),
                              ([], {"PET_RDZV_ENDPOINT": endpoint}, "env PET_RDZV_ENDPOINT")):
        if not endpoint and env:
            continue  # an empty PET_ variable counts as unset, as under torchrun
        with pytest.raises(LaunchError) as info:
            parse_plan(["--nnodes", "2", "--node-rank", "1", *argv, script], env=env)
        message = str(info.value)
        assert message.startswith(f"{source} {endpoint!r}: {why}; expected HOST, HOST:PORT or [IPv6]:PORT"), message
        assert "\n" not in message


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--master_addr", "tcp://10.0.0.1"], {}, "--master_addr 'tcp://10.0.0.1' is not a host name or an IP address"),
    ([], {"MASTER_ADDR": "h:29500"}, "env MASTER_ADDR 'h:29500' is not a host name or an IP address"),
    ([], {"PET_MASTER_ADDR": "h:1"}, "env PET_MASTER_ADDR 'h:1' is not a host name or an IP address"),
    (["--master_addr", "[::1]"], {}, "(write an IPv6 address without brackets)"),
    (["--log-dir", ""], {}, "--log-dir '': expected a path"),
    (["--log_dir", " "], {}, "--log-dir ' ': expected a path"),
    (["--run_directory", ""], {}, "--run_directory '': expected a path"),
    (["--stdout", ""], {}, "--stdout '': expected a path"),
])
def test_values_that_would_be_read_as_something_else_are_usage_errors(script, argv, env, needle) -> None:
    with pytest.raises(LaunchError) as info:
        parse_plan([*argv, script], env=env)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_an_ipv6_master_addr_without_brackets_is_taken(script) -> None:
    assert parse_plan(["--master_addr", "::1", script], env={}).master_addr == "::1"
