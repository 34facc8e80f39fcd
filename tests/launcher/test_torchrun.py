"""torchrun compatibility end to end: the torchelastic environment, @record error files, torchrun's
command line and --tee, with real worker processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launcher.conftest import launch

pytestmark = pytest.mark.timeout(120)

ELASTIC_KEYS = ["TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_ERROR_FILE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "RANK", "WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]

ELASTIC_DUMP = textwrap.dedent(f"""
    import json, os, sys
    import torch.distributed as dist
    env = {{k: os.environ.get(k) for k in {ELASTIC_KEYS!r}}}
    env["launched"] = dist.is_torchelastic_launched()
    json.dump(env, open(os.path.join(sys.argv[1], "env" + os.environ["RANK"] + ".json"), "w"))
""")

RECORD = textwrap.dedent("""
    import os, sys, time
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if os.environ["RANK"] == sys.argv[1] and attempt == 0:
            raise ValueError("rank broke on purpose: the answer is 42")
        if os.environ["RANK"] == sys.argv[1]:
            sys.exit(3)  # no exception, so no error file this time
        time.sleep(60)

    main()
""")


def test_workers_see_the_torchelastic_environment(tmp_path: Path, write_script) -> None:
    script = write_script("elastic.py", ELASTIC_DUMP)
    result = launch(["--nproc-per-node", "2", "--rdzv-id", "job7", "--max-restarts", "1", "--role", "trainer",
                     "--run_directory", "run", str(script), str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        env = json.loads((tmp_path / f"env{rank}.json").read_text())
        assert env["launched"] is True
        assert env == {
            "launched": True, "RANK": str(rank), "WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "1",
            "TORCHELASTIC_ERROR_FILE": str(tmp_path / "run" / f"rank{rank}.error.json"),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "trainer",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "2",
            # torchrun's agent sets it unless the launcher's environment has it
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }


@pytest.mark.parametrize("failing_rank", ["1", "0"])
def test_record_error_file_reaches_the_failure_report(tmp_path: Path, write_script, failing_rank) -> None:
    script = write_script("record.py", RECORD)
    result = launch(["-n", "2", "--run_directory", "run", str(script), failing_rank], cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert f"rank {failing_rank} raised ValueError: rank broke on purpose: the answer is 42" in result.stderr
    if failing_rank == "1":  # its output is in files: the report shows the traceback from the error file
        assert f"traceback of rank 1 (from {tmp_path / 'run' / 'rank1.error.json'})" in result.stderr
        assert 'raise ValueError("rank broke on purpose' in result.stderr
    else:  # local rank 0's traceback is on the console already
        assert "rank 0's output is on the console above" in result.stderr
        assert result.stderr.count("Traceback (most recent call last)") == 1


def test_an_error_file_from_an_earlier_attempt_is_not_reported(tmp_path: Path, write_script) -> None:
    script = write_script("record.py", RECORD)
    result = launch(["-n", "2", "--max_restarts", "1", "--run_directory", "run", str(script), "1"], cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("raised ValueError") == 1  # attempt 0 only
    last_report = result.stderr.rsplit("restarting this node's ranks", 1)[1]
    assert "failed first with exit code 3" in last_report and "raised" not in last_report


ALL_REDUCE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}")
    print(f"err from rank {dist.get_rank()}", file=sys.stderr)
""")


def test_torchrun_command_line_runs_two_ranks(tmp_path: Path, write_script) -> None:
    script = write_script("allreduce.py", ALL_REDUCE)
    result = launch(["--nnodes", "1", "--nproc-per-node", "2", "--standalone", "--log-dir", "logs",
                     str(script)], cwd=tmp_path, env={"WORLD_SIZE": "8", "MASTER_PORT": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "rank 0 of 2 sum 3"
    assert (tmp_path / "logs" / "rank1.stdout.log").read_text().strip() == "rank 1 of 2 sum 3"


TALKER = textwrap.dedent("""
    import os, sys, time
    rank = os.environ["RANK"]
    print(f"out {rank}", flush=True)
    print(f"err {rank}", file=sys.stderr, flush=True)
    go = os.path.join(sys.argv[1], "go")
    while not os.path.exists(go):  # the test creates it once it saw both ranks' lines live
        time.sleep(0.05)
    sys.stdout.write(f"last words of {rank} without a newline")
""")


def test_tee_streams_every_rank_live_with_a_prefix(tmp_path: Path, write_script) -> None:
    script = write_script("talker.py", TALKER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "-n", "2", "--tee", "3", "--run_directory", "run",
         str(script), str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = {launcher.stdout.readline().strip(), launcher.stdout.readline().strip()}
    assert seen == {"[default0]:out 0", "[default1]:out 1"}  # while both ranks still run
    (tmp_path / "go").write_text("")
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert sorted(out.splitlines()) == ["[default0]:last words of 0 without a newline",
                                        "[default1]:last words of 1 without a newline"]
    assert "[default0]:err 0" in err and "[default1]:err 1" in err
    for rank in range(2):  # the log files get the same output, unprefixed
        log = tmp_path / "run" / f"rank{rank}.stdout.log"
        assert log.read_text() == f"out {rank}\nlast words of {rank} without a newline"
        assert (tmp_path / "run" / f"rank{rank}.stderr.log").read_text() == f"err {rank}\n"


def test_tee_of_stdout_only_and_the_local_ranks_filter(tmp_path: Path, write_script) -> None:
    script = write_script("talker.py", TALKER)
    (tmp_path / "go").write_text("")
    result = launch(["-n", "2", "--tee", "1", "--local-ranks-filter", "1", "--run_directory", "run",
                     str(script), str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[default1]:out 1", "[default1]:last words of 1 without a newline"]
    assert result.stderr.splitlines() == ["err 0"]  # local rank 0's stderr, as without --tee
    assert (tmp_path / "run" / "rank0.stdout.log").read_text().startswith("out 0\n")


# Rank 1 breaks attempt 0 only once rank 0 has printed (the marker file), so that a loaded
# machine cannot end rank 0 before its lines are out under one launcher and not the other.
ATTEMPTS = textwrap.dedent("""
    import os, sys, time
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        attempt, local = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), os.environ["LOCAL_RANK"]
        print(f"out {local} attempt {attempt} run {os.environ['TORCHELASTIC_RUN_ID']}", flush=True)
        print(f"err {local} attempt {attempt}", file=sys.stderr, flush=True)
        if local == "0" and attempt == 0:
            open("rank0-printed", "w").close()
        if local == "1" and attempt == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists("rank0-printed") and time.monotonic() < deadline:
                time.sleep(0.05)
            os.remove("rank0-printed")
            raise ValueError("rank broke on purpose")

    main()
""")


LINES = textwrap.dedent("""
    import os, sys
    local = os.environ["LOCAL_RANK"]
    print(f"out {local}", flush=True)
    print(f"err {local}", file=sys.stderr, flush=True)
    print(f"out {local} again", flush=True)
""")


def _torchrun(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=90)


def _run_folder(log_dir: Path) -> tuple[Path, dict[str, Path]]:
    """The one folder torchrun's layout made under ``log_dir``, and its files by relative path."""
    (folder,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return folder, {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}


def test_log_dir_keeps_torchruns_layout_beside_locksteps_logs(tmp_path: Path, write_script) -> None:
    script = write_script("attempts.py", ATTEMPTS)
    args = ["--max-restarts", "1", "-r", "3", str(script)]
    theirs = _torchrun(["--nproc-per-node", "2", "--log-dir", "tr", *args], cwd=tmp_path)
    ours = launch(["--nproc-per-node", "2", "--log-dir", "ls", *args], cwd=tmp_path)
    assert theirs.returncode == 0 and ours.returncode == 0, (theirs.stderr, ours.stderr)
    their_folder, their_files = _run_folder(tmp_path / "tr")
    our_folder, our_files = _run_folder(tmp_path / "ls")
    assert list(our_files) == list(their_files) == [
        "attempt_0/0/stderr.log", "attempt_0/0/stdout.log",
        "attempt_0/1/error.json", "attempt_0/1/stderr.log", "attempt_0/1/stdout.log",
        "attempt_1/0/stderr.log", "attempt_1/0/stdout.log", "attempt_1/1/stderr.log", "attempt_1/1/stdout.log"]
    for folder, files in ((their_folder, their_files), (our_folder, our_files)):
        run_id = files["attempt_1/0/stdout.log"].read_text().split(" run ")[1].strip()
        assert re.fullmatch(re.escape(run_id) + r"_[a-z0-9_]{8}", folder.name), folder.name
    for name in their_files:  # each attempt's own output, as under torchrun
        if name.endswith("stdout.log"):
            assert our_files[name].read_text().split(" run ")[0] == their_files[name].read_text().split(" run ")[0]
        if name.endswith("stderr.log") and name != "attempt_0/1/stderr.log":  # a traceback's frames differ
            assert our_files[name].read_text() == their_files[name].read_text()
    error = json.loads(our_files["attempt_0/1/error.json"].read_text())["message"]
    assert error["message"] == json.loads(their_files["attempt_0/1/error.json"].read_text())["message"]["message"]
    assert f"traceback of rank 1 (from {our_files['attempt_0/1/error.json']})" in ours.stderr
    for rank in (0, 1):  # lockstep's names show the last attempt's files
        for stream in ("stdout", "stderr"):
            mine = tmp_path / "ls" / f"rank{rank}.{stream}.log"
            assert mine.samefile(our_files[f"attempt_1/{rank}/{stream}.log"])


def test_tee_prefixes_lines_as_torchrun_does(tmp_path: Path, write_script) -> None:
    script = write_script("lines.py", LINES)
    theirs = _torchrun(["--nproc-per-node", "2", "--tee", "3", str(script)], tmp_path)
    ours = launch(["-n", "2", "--tee", "3", "--run_directory", "run", str(script)], cwd=tmp_path)
    assert theirs.returncode == 0 and ours.returncode == 0, (theirs.stderr, ours.stderr)
    assert sorted(ours.stdout.splitlines()) == sorted(theirs.stdout.splitlines()) == [
        "[default0]:out 0", "[default0]:out 0 again", "[default1]:out 1", "[default1]:out 1 again"]
    for line in ("[default0]:err 0", "[default1]:err 1"):
        assert line in ours.stderr.splitlines() and line in theirs.stderr.splitlines()
    # a value per local rank: 0's stdout, 1's both (torchrun's Std.from_str syntax)
    mapped = launch(["-n", "2", "-t", "0:1,1:3", "--run_directory", "run", str(script)], cwd=tmp_path)
    assert sorted(mapped.stdout.splitlines()) == sorted(ours.stdout.splitlines())
    assert "[default1]:err 1" in mapped.stderr and "err 0" in mapped.stderr.splitlines()  # 0's stderr: console
    custom = launch(["-n", "2", "--tee", "1", "--role", "trainer", "--run_directory", "run", str(script)],
                    cwd=tmp_path, env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}> "})
    assert sorted(custom.stdout.splitlines())[:2] == ["<trainer|0> out 0", "<trainer|0> out 0 again"]


STANDALONE_ENV = textwrap.dedent("""
    import json, os, sys
    launcher = json.loads(sys.argv[1])
    mine = {k: v for k, v in os.environ.items() if launcher.get(k) != v}
    json.dump(mine, open(os.path.join(sys.argv[2], sys.argv[3] + os.environ["LOCAL_RANK"] + ".json"), "w"))
""")


def test_standalone_gives_the_ranks_torchruns_environment(tmp_path: Path, write_script) -> None:
    script = write_script("env.py", STANDALONE_ENV)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    base = json.dumps(env)
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), base, str(tmp_path), "theirs"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=90)
    ours = subprocess.run([sys.executable, "-m", "lockstep", "--standalone", "--nproc-per-node", "2",
                           str(script), base, str(tmp_path), "ours"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90)
    assert theirs.returncode == 0 and ours.returncode == 0, (theirs.stderr, ours.stderr)
    for local in (0, 1):
        t, o = (json.loads((tmp_path / f"{who}{local}.json").read_text()) for who in ("theirs", "ours"))
        assert set(t) <= set(o), set(t) - set(o)  # every variable torchrun sets, lockstep sets too
        same = ["MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
        assert {k: o[k] for k in same} == {k: t[k] for k in same}
        assert o["MASTER_ADDR"] == "localhost" and o["NODE_RANK"] == "0"  # torchrun sets no NODE_RANK
        for run_id in (t["TORCHELASTIC_RUN_ID"], o["TORCHELASTIC_RUN_ID"]):
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", run_id)


def test_rdzv_endpoint_with_port_0_picks_a_free_port(tmp_path: Path, write_script) -> None:
    script = write_script("allreduce.py", ALL_REDUCE)
    result = launch(["--nproc-per-node", "2", "--rdzv-endpoint", "localhost:0", "--run_directory", "run",
                     str(script)], cwd=tmp_path, env={"MASTER_PORT": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "rank 0 of 2 sum 3"
