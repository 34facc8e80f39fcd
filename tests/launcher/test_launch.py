"""The launcher end to end: real worker processes, gloo, a timeout on every run."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.launcher.conftest import launch, wait_for_files, wait_gone

pytestmark = pytest.mark.timeout(120)

ENV_DUMP = textwrap.dedent("""
    import json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "LOCKSTEP_RESTART_COUNT"]
    out = os.path.join(sys.argv[1], "env" + os.environ["RANK"] + ".json")
    json.dump({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}, open(out, "w"))
""")

ALL_REDUCE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} node {os.environ['NODE_RANK']} "
          f"local {os.environ['LOCAL_RANK']} sum {t.item():g}")
    print(f"err from rank {dist.get_rank()}", file=sys.stderr)
""")


AFTER_A_DESTROYED_GROUP = textwrap.dedent("""
    import torch, torch.distributed as td
    from lockstep import dist
    td.init_process_group("gloo")  # as mosaicml-streaming's StreamingDataset does while no group exists
    td.barrier()
    td.destroy_process_group()
    dist.initialize_dist("cpu")  # what Trainer(...) calls
    t = torch.ones(1)
    td.all_reduce(t)
    assert t.item() == dist.get_world_size() == 3
""")


def test_a_default_group_made_after_one_destroyed_never_reads_that_ones_addresses(tmp_path: Path,
                                                                                   write_script) -> None:
    # the launcher's store outlives the first group, whose keys torch would name the second's by:
    # before, 2 runs of 2 at 3 ranks failed ("connectFullMesh failed ... Connection refused"; torchrun: 2 of 2)
    script = write_script("regroup.py", AFTER_A_DESTROYED_GROUP)
    for _ in range(2):
        result = launch(["-n", "3", str(script)], cwd=tmp_path)
        assert result.returncode == 0, result.stderr


def test_env_contract_for_two_ranks(tmp_path: Path, write_script) -> None:
    script = write_script("dump.py", ENV_DUMP)
    result = launch(["-n", "2", str(script), str(tmp_path), "--flag"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(2)]
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PYTHONUNBUFFERED"] == "1" and env["LOCKSTEP_RESTART_COUNT"] == "0"
        assert env["argv"] == [str(tmp_path), "--flag"]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0


def test_plain_torch_script_console_and_rank_files(tmp_path: Path, write_script) -> None:
    script = write_script("allreduce.py", ALL_REDUCE)
    fmt = str(tmp_path / "logs" / "{rank}-{local_rank}-{world_size}-{node_rank}-{local_world_size}")
    result = launch(["-n", "2", "--stdout", fmt + ".out", "--stderr", fmt + ".err", str(script)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # Only local rank 0 reaches the console; rank 1 goes to its format files.
    assert result.stdout.strip() == "rank 0 of 2 node 0 local 0 sum 3"
    assert "err from rank 0" in result.stderr and "rank 1" not in result.stderr
    assert (tmp_path / "logs" / "1-1-2-0-2.out").read_text().strip() == "rank 1 of 2 node 0 local 1 sum 3"
    assert "err from rank 1" in (tmp_path / "logs" / "1-1-2-0-2.err").read_text()


def test_other_ranks_output_is_kept_under_run_directory(tmp_path: Path, write_script) -> None:
    script = write_script("allreduce.py", ALL_REDUCE)
    result = launch(["-n", "2", "--run_directory", "myrun", str(script)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sum 3" in (tmp_path / "myrun" / "rank1.stdout.log").read_text()
    assert "err from rank 1" in (tmp_path / "myrun" / "rank1.stderr.log").read_text()


def test_module_and_command_modes(tmp_path: Path, write_script) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "dump.py").write_text(ENV_DUMP)
    result = launch(["-n", "2", "-m", "pkg.dump", str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "env1.json").read_text())["RANK"] == "1"

    result = launch(["-n", "2", "-c", "sh", "-c", 'echo "cmd rank $RANK of $WORLD_SIZE"'], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cmd rank 0 of 2"


def test_a_folder_with_a_main_module_runs_as_the_script(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text(ENV_DUMP)
    result = launch(["-n", "2", "app", str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "env1.json").read_text())["RANK"] == "1"


def test_command_mode_runs_a_torch_script_through_the_launcher_store(tmp_path: Path, write_script) -> None:
    # -c runs the command as is, without lockstep's exit hook, so the script tears down itself.
    script = write_script("allreduce.py", ALL_REDUCE + "dist.destroy_process_group()\n")
    result = launch(["-n", "2", "-c", sys.executable, str(script)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sum 3" in result.stdout


def test_failing_rank_exit_code_report_and_teardown(tmp_path: Path, write_script) -> None:
    script = write_script("fail.py", textwrap.dedent("""
        import os, sys, time
        open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
        if os.environ["RANK"] == "1":
            time.sleep(1)
            print("rank one is failing on purpose", file=sys.stderr)
            sys.exit(3)
        time.sleep(120)
    """))
    result = launch(["-n", "2", str(script), str(tmp_path)], cwd=tmp_path, timeout=60)
    assert result.returncode == 3, result.stderr
    assert "rank 1 (local rank 1" in result.stderr and "failed first with exit code 3" in result.stderr
    assert "rank one is failing on purpose" in result.stderr
    assert "0 (signal SIGTERM)" in result.stderr
    assert wait_gone([int((tmp_path / f"pid{r}").read_text()) for r in range(2)], timeout=5) == []


def test_rank_killed_by_signal_reports_the_signal(tmp_path: Path, write_script) -> None:
    script = write_script("segv.py", textwrap.dedent("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(120)
    """))
    result = launch(["-n", "2", str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 128 + signal.SIGSEGV
    assert "rank 1" in result.stderr and "signal SIGSEGV" in result.stderr


SLEEPER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    rank = os.environ["RANK"]
    path = os.path.join(sys.argv[1], "pids" + rank)
    open(path + ".tmp", "w").write(f"{os.getpid()} {child.pid}")
    os.rename(path + ".tmp", path)
    time.sleep(300)
""")


def _start_sleepers(tmp_path: Path, write_script) -> tuple[subprocess.Popen, list[int]]:
    script = write_script("sleeper.py", SLEEPER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "-n", "2", "--grace_period", "2", str(script), str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    files = [tmp_path / f"pids{r}" for r in range(2)]
    wait_for_files(files)
    pids = [int(p) for f in files for p in f.read_text().split()]
    return launcher, pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_is_forwarded_and_leaves_nothing(tmp_path: Path, write_script, signum) -> None:
    launcher, pids = _start_sleepers(tmp_path, write_script)
    launcher.send_signal(signum)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signum
    assert f"received {signal.Signals(signum).name}" in err
    assert wait_gone(pids, timeout=5) == []


SESSION_DUMP = textwrap.dedent("""
    import json, os, sys
    json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0)},
              open(os.path.join(sys.argv[1], "session" + os.environ["RANK"] + ".json"), "w"))
""")


def test_each_rank_leads_a_process_group_in_the_launchers_session(tmp_path: Path, write_script) -> None:
    """One session: where the kernel shares CPU between sessions first, idle-priority work beside
    the ranks (an upload process) would otherwise take a fair share of their cores."""
    script = write_script("session.py", SESSION_DUMP)
    launcher = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", str(script), str(tmp_path)],
                                cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)  # its watchdog then stops the ranks
    assert launcher.returncode == 0, err
    ranks = [json.loads((tmp_path / f"session{r}.json").read_text()) for r in range(2)]
    assert [r["sid"] for r in ranks] == [launcher.pid] * 2  # the launcher leads the session it was started in
    assert all(r["pgid"] == r["pid"] for r in ranks)


def test_a_rank_writing_to_the_launchers_terminal_is_never_stopped(tmp_path: Path, write_script) -> None:
    """The ranks are in background groups of the launcher's terminal; with ``stty tostop`` a write
    from there would stop them (and the job would hang) unless SIGTTOU is ignored."""
    import fcntl
    import termios

    script = write_script("talk.py", textwrap.dedent("""
        import sys, termios
        if sys.stdout.isatty():  # rank 0's console output is the launcher's terminal itself
            print("hello from the terminal", flush=True)
            termios.tcsetattr(1, termios.TCSANOW, termios.tcgetattr(1))
    """))
    master, tty = os.openpty()
    attrs = termios.tcgetattr(tty)
    attrs[3] |= termios.TOSTOP
    termios.tcsetattr(tty, termios.TCSANOW, attrs)
    launcher = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", str(script)], cwd=tmp_path,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=tty, stdout=tty, stderr=tty,
                                start_new_session=True,  # then the terminal becomes its controlling one
                                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # noqa: PLW1509
    os.close(tty)
    output, deadline = b"", time.monotonic() + 60
    try:
        # read as it comes, so the terminal's buffer never fills; a stopped rank keeps it open
        while select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not chunk:
                break
            output += chunk
        assert launcher.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, output.decode(errors="replace")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        os.close(master)
    assert output.count(b"hello from the terminal") == 1, output.decode(errors="replace")


def _sigterm_when_ready(tmp_path: Path, script: Path, *flags: str) -> tuple[int, str]:
    """Launch two ranks of ``script``, SIGTERM the launcher once both wrote their ready file."""
    launcher = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", *flags, str(script), str(tmp_path)],
                                cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_files([tmp_path / "ready0", tmp_path / "ready1"])
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    return launcher.returncode, err


def test_a_rank_that_fails_on_its_way_out_is_not_reported_as_a_clean_preemption(tmp_path: Path,
                                                                               write_script) -> None:
    # rank 1 stops as asked (exit 143, as the Trainer does after its checkpoint); rank 0 fails instead
    script = write_script("unclean.py", textwrap.dedent("""
        import os, signal, sys, time
        rank = os.environ["RANK"]
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143 if rank == "1" else 3))
        open(os.path.join(sys.argv[1], "ready" + rank), "w").write("x")
        time.sleep(300)
    """))
    code, err = _sigterm_when_ready(tmp_path, script)
    assert code == 3, err
    assert "after SIGTERM, rank 0 did not stop cleanly" in err and "exit code 3" in err, err


def test_a_rank_killed_after_its_grace_period_is_a_stop_as_asked_not_a_failure(tmp_path: Path,
                                                                               write_script) -> None:
    # rank 0 is still saving when the grace period ends, so the launcher kills it: its own SIGKILL
    # is not the job's failure (issue 37)
    script = write_script("slow.py", textwrap.dedent("""
        import os, signal, sys, time
        rank = os.environ["RANK"]
        def stop(*_):
            if rank == "0":
                time.sleep(60)
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        open(os.path.join(sys.argv[1], "ready" + rank), "w").write("x")
        time.sleep(300)
    """))
    code, err = _sigterm_when_ready(tmp_path, script, "--grace_period", "1")
    assert code == 128 + signal.SIGTERM, err
    assert "after SIGTERM, rank 0 did not exit within the 1 s grace period (--grace_period) and was killed" in err
    assert "failed first" not in err and "did not stop cleanly" not in err, err


def test_sigkill_to_launcher_leaves_no_orphans(tmp_path: Path, write_script) -> None:
    launcher, pids = _start_sleepers(tmp_path, write_script)
    launcher.kill()
    launcher.communicate(timeout=30)
    assert wait_gone(pids, timeout=10) == []


def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path: Path, write_script) -> None:
    script = write_script("stubborn.py", textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
        if os.environ["RANK"] == "1":
            time.sleep(1)
            sys.exit(5)
        time.sleep(300)
    """))
    result = launch(["-n", "2", "--grace_period", "1", str(script), str(tmp_path)], cwd=tmp_path, timeout=60)
    assert result.returncode == 5
    assert "0 (signal SIGKILL)" in result.stderr
    assert wait_gone([int((tmp_path / "pid0").read_text())], timeout=5) == []


def test_two_launchers_form_one_world_of_four(tmp_path: Path, write_script) -> None:
    script = write_script("allreduce.py", ALL_REDUCE)
    port = str(free_port())
    common = ["-n", "2", "--world_size", "4", "--master_addr", "127.0.0.1", "--master_port", port]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "lockstep", *common, "--node_rank", str(node),
         "--stdout", str(tmp_path / "out{rank}"), str(script)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outs = [n.communicate(timeout=90) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    lines = {outs[0][0].strip(), outs[1][0].strip(),
             (tmp_path / "out1").read_text().strip(), (tmp_path / "out3").read_text().strip()}
    assert lines == {f"rank {r} of 4 node {r // 2} local {r % 2} sum 10" for r in range(4)}


def test_store_port_is_held_before_rank_zero_starts(tmp_path: Path, write_script) -> None:
    # Anyone who tries to take MASTER_PORT while the job runs (here: rank 0 itself) cannot.
    script = write_script("grab.py", textwrap.dedent("""
        import os, socket
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            print("port was free")
        except OSError:
            print("port is held")
    """))
    result = launch(["-n", "1", str(script)], cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "port is held"


def test_busy_master_port_is_a_usage_error(tmp_path: Path, write_script) -> None:
    script = write_script("noop.py", "")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = launch(["--master_port", str(busy.getsockname()[1]), str(script)], cwd=tmp_path)
    assert result.returncode == 2 and "--master_port" in result.stderr


def test_exit_right_after_a_collective_does_not_abort(tmp_path: Path, write_script) -> None:
    # torch 2.13 + gloo: exiting after a collective without destroy_process_group can SIGABRT;
    # the worker bootstrap tears the group down at exit. Without it this fails ~1 run in 3.
    script = write_script("trap.py", textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(4)
        dist.all_reduce(t)
    """))
    for _ in range(4):
        result = launch(["-n", "2", str(script)], cwd=tmp_path)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("as_command", [False, True], ids=["script", "command"])
def test_max_restarts_starts_the_ranks_again(tmp_path: Path, write_script, as_command: bool) -> None:
    # a command's ranks rendezvous in the store the launcher hosts: a restart's need a fresh one
    script = write_script("flaky.py", textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        restart = int(os.environ["LOCKSTEP_RESTART_COUNT"])
        if restart < 2 and dist.get_rank() == 1:
            sys.exit(7)
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"attempt {restart} sum {t.item():g}")
        # a process that exits with its gloo group alive may abort in torch's teardown (pytorch
        # issue 190489; a command runs without lockstep's bootstrap, which destroys it at exit)
        dist.destroy_process_group()
    """))
    target = ["-c", sys.executable, str(script)] if as_command else [str(script)]
    result = launch(["-n", "2", "--max_restarts", "2", *target], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "attempt 2 sum 2"
    assert result.stderr.count("restarting this node's ranks") == 2
    if as_command:
        return  # what follows does not depend on how the ranks start; fresh interpreters cost ~8 s of CPU

    result = launch(["-n", "2", "--max_restarts", "1", *target], cwd=tmp_path)
    assert result.returncode == 7


@pytest.mark.parametrize("fast_exit", ["1", "0"])
def test_unclosed_files_in_globals_are_flushed_at_exit(tmp_path: Path, write_script, fast_exit) -> None:
    # What `python script.py` guarantees must hold under the bootstrap and its fast exit too.
    script = write_script("unclosed.py", textwrap.dedent("""
        import sys, torch
        class Holder:
            def __init__(self, path):
                self.f = open(path, "w")
                self.me = self  # a reference cycle: only the garbage collector frees it
        plain = open(sys.argv[1] + "/plain.txt", "w")
        plain.write("plain data")
        cyclic = Holder(sys.argv[1] + "/cyclic.txt")
        cyclic.f.write("cyclic data")
        print(__name__, __file__ == sys.argv[0], __spec__)
    """))
    result = launch(["-n", "1", str(script), str(tmp_path)], cwd=tmp_path, env={"LOCKSTEP_FAST_EXIT": fast_exit})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "__main__ True None"
    assert (tmp_path / "plain.txt").read_text() == "plain data"
    assert (tmp_path / "cyclic.txt").read_text() == "cyclic data"


def test_a_launcher_flag_after_the_script_is_noted_on_stderr(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\n")
    result = launch([str(script), "--nproc_per_node=2"], cwd=tmp_path, timeout=60)
    assert result.returncode == 0 and "args ['--nproc_per_node=2']" in result.stdout
    assert result.stderr.startswith(f"lockstep: note: the launcher's flags after {script} (--nproc_per_node=2) go to "
                                    "the script")
