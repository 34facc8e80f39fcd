"""torchrun compatibility end to end: the torchelastic environment, @record error files, torchrun's
command line and --tee, with real worker processes."""

from __future__ import annotations

import json
import os
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
    assert seen == {"[rank 0] out 0", "[rank 1] out 1"}  # while both ranks still run
    (tmp_path / "go").write_text("")
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert sorted(out.splitlines()) == ["[rank 0] last words of 0 without a newline",
                                        "[rank 1] last words of 1 without a newline"]
    assert "[rank 0] err 0" in err and "[rank 1] err 1" in err
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
    assert result.stdout.splitlines() == ["[rank 1] out 1", "[rank 1] last words of 1 without a newline"]
    assert result.stderr.splitlines() == ["err 0"]  # local rank 0's stderr, as without --tee
    assert (tmp_path / "run" / "rank0.stdout.log").read_text().startswith("out 0\n")
