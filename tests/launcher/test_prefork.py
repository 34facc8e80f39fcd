"""Ranks forked from a server that imported torch once (lockstep.launcher.prefork): each is still a
process of its own, as the launcher's child, with its own environment, streams and random state;
``LOCKSTEP_PREFORK=0`` starts fresh interpreters; and no server outlives its launcher."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torch import version as torch_version

from lockstep.launcher.prefork import preload_list
from tests.launcher.conftest import launch, wait_for_files, wait_gone

pytestmark = pytest.mark.timeout(120)

REPORT = textwrap.dedent("""
    import sys
    # before this script imported anything: torch, and what it imports of lockstep (below)
    preloaded = ["torch" in sys.modules, "lockstep.trainer.trainer" in sys.modules]
    import json, os, numpy
    rank = os.environ["RANK"]
    print(f"out of rank {rank}")
    print(f"err of rank {rank}", file=sys.stderr)
    report = {"preloaded": preloaded, "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
              "cwd": os.getcwd(), "argv": sys.argv[1:], "draw": float(numpy.random.rand()),
              "local_rank": os.environ["LOCAL_RANK"], "mine": os.environ.get("MINE")}
    with open(os.path.join(sys.argv[1], f"report{rank}.json"), "w") as f:
        json.dump(report, f)
    from lockstep import Trainer
""")


def _reports(folder: Path, prefork: str, write_script) -> tuple[list[dict], subprocess.CompletedProcess[str]]:
    script = write_script("report.py", REPORT)
    out = folder / prefork
    out.mkdir()
    launcher = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", "--log_dir", str(out / "logs"),
                                 "--redirects", "3", str(script), str(out), "two words"], cwd=out,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "LOCKSTEP_PREFORK": prefork, "MINE": "x"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = launcher.communicate(timeout=90)
    result = subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr)
    assert result.returncode == 0, stderr
    reports = [json.loads((out / f"report{r}.json").read_text()) for r in range(2)]
    for report in reports:
        report["launcher"] = launcher.pid
    return reports, result


@pytest.mark.parametrize("prefork", ["1", "0"])
def test_each_rank_is_a_process_of_its_own_forked_or_not(tmp_path: Path, write_script, prefork: str) -> None:
    reports, _ = _reports(tmp_path, prefork, write_script)
    assert [r["preloaded"] for r in reports] == [[prefork == "1"] * 2] * 2
    for rank, report in enumerate(reports):
        assert report["ppid"] == report["launcher"]  # re-parented to the launcher, which waits for it
        assert report["pgid"] == report["pid"]  # the leader of a process group of its own
        assert report["cwd"] == str(tmp_path / prefork)
        assert report["argv"] == [str(tmp_path / prefork), "two words"]
        assert (report["local_rank"], report["mine"]) == (str(rank), "x")
        logs = next((tmp_path / prefork / "logs").rglob(f"rank{rank}.stdout.log")).parent
        assert (logs / f"rank{rank}.stdout.log").read_text() == f"out of rank {rank}\n"
        assert (logs / f"rank{rank}.stderr.log").read_text() == f"err of rank {rank}\n"
    assert reports[0]["draw"] != reports[1]["draw"]  # numpy's generator was not copied from the server


def test_the_server_imports_what_the_script_imports_of_torch_and_lockstep_only(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, numpy, torchvision
        import torch.nn as nn
        from lockstep import Trainer, dist
        from mypackage import model
        def main():
            from lockstep.callbacks import LRMonitor
    """))
    assert preload_list({}, str(script)) == (
        "torch", "torch.distributed", "torch._dynamo", "torch.nn", "lockstep", "lockstep:Trainer", "lockstep:dist",
        "lockstep.callbacks", "lockstep.callbacks:LRMonitor")
    assert preload_list({"LOCKSTEP_PREFORK": "torch,numpy"}, str(script)) == ("torch", "numpy")
    assert preload_list({"LOCKSTEP_PREFORK": "0"}, str(script)) == ()
    assert preload_list({"LOCKSTEP_PREFORK": "+deepspeed, numpy"}, str(script)) == (
        *preload_list({}, str(script)), "deepspeed", "numpy")  # what is read, and these as well


def test_the_server_follows_the_scripts_own_modules_for_what_they_import(tmp_path: Path) -> None:
    # a model whose metrics come from torchmetrics, in a module beside the script: preloaded too
    (tmp_path / "train.py").write_text("from mymodels import Net\nimport helpers.data\nimport yaml\n")
    (tmp_path / "mymodels.py").write_text("import torchmetrics\nimport train  # a circle: read once\n"
                                          "from torchmetrics.classification import MulticlassAccuracy\n")
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "helpers" / "data.py").write_text("from lockstep import dist\nimport requests\n")
    (tmp_path / "yaml.py").write_text("def (:\n")  # unreadable: skipped, never run
    assert preload_list({}, str(tmp_path / "train.py")) == (
        "torch", "torch.distributed", "torch._dynamo", "lockstep", "lockstep:dist", "torchmetrics",
        "torchmetrics.classification", "torchmetrics.classification:MulticlassAccuracy")


def test_a_script_of_the_standard_library_and_its_own_modules_alone_starts_without_a_server(
        tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("import os, sys\nfrom json import dumps\nimport helpers.io\n"
                                       "from mine import thing\n")
    (tmp_path / "mine.py").write_text("import time\nimport plain  # a circle: read once\n")
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "io.py").write_text("from collections import deque\n")
    assert preload_list({}, str(tmp_path / "plain.py")) == ()
    # anything else may import torch: the server preloads it as before
    (tmp_path / "mine.py").write_text("import time\nimport numpy\n")
    assert preload_list({}, str(tmp_path / "plain.py")) == ("torch", "torch.distributed", "torch._dynamo")
    (tmp_path / "mine.py").write_text("from . import sibling\n")  # relative: not followed
    assert preload_list({}, str(tmp_path / "plain.py")) == ("torch", "torch.distributed", "torch._dynamo")
    (tmp_path / "mine.py").write_text("def (:\n")  # not python: cannot be read
    assert preload_list({}, str(tmp_path / "plain.py")) == ("torch", "torch.distributed", "torch._dynamo")
    assert preload_list({"LOCKSTEP_PREFORK": "torch"}, str(tmp_path / "helpers" / "io.py")) == ("torch",)


def test_torch_dynamo_is_left_out_for_a_script_of_collectives_alone(tmp_path: Path) -> None:
    # torch._dynamo (~45% of a server's import) is imported by every optimizer's constructor, DDP's
    # and torch.compile: a script whose files name none of them, and that imports nothing but torch
    # and lockstep.dist, has no rank that imports it
    (tmp_path / "job.py").write_text("import os, torch, torch.distributed as dist\nfrom lockstep import dist as ld\n"
                                     "import mine\ndist.init_process_group('gloo')\ndist.all_reduce(torch.ones(1))\n")
    (tmp_path / "mine.py").write_text("import lockstep.dist\n")
    assert preload_list({}, str(tmp_path / "job.py")) == ("torch", "torch.distributed", "lockstep", "lockstep:dist",
                                                          "lockstep.dist")
    for added in ("model = torch.nn.parallel.DistributedDataParallel(net)", "opt = make_optimizer()",
                  "torch.compile(f)", "from lockstep import Trainer", "import numpy", "from . import x"):
        (tmp_path / "mine.py").write_text(f"import lockstep.dist\n{added}\n")
        assert "torch._dynamo" in preload_list({}, str(tmp_path / "job.py")), added
    (tmp_path / "mine.py").write_text("def (:\n")  # cannot be read: as before
    assert "torch._dynamo" in preload_list({}, str(tmp_path / "job.py"))


def test_the_rank_whose_script_failed_is_named_not_the_peer_its_exit_broke(tmp_path: Path, write_script) -> None:
    # rank 1 exits with 7; its teardown breaks rank 0's all_reduce, and rank 0, raising at once,
    # may be out before rank 1 has finished exiting
    script = write_script("one_fails.py", textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            sys.exit(7)
        dist.all_reduce(torch.ones(1))
    """))
    for _ in range(3):
        result = launch(["-n", "2", str(script)], cwd=tmp_path)
        assert result.returncode == 7, result.stderr
        assert "rank 1 (local rank 1" in result.stderr and "failed first with exit code 7" in result.stderr


def _job_processes(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                found.append(int(name))
        except OSError:
            pass
    return found


def test_sigkill_of_the_launcher_leaves_neither_the_server_nor_a_rank(tmp_path: Path, write_script) -> None:
    script = write_script("sleeper.py", textwrap.dedent("""
        import os, sys, time
        import torch  # a script of the standard library alone starts its ranks without a server
        open(os.path.join(sys.argv[1], "ready" + os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(120)
    """))
    launcher = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "2", str(script), str(tmp_path)],
                                cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_files([tmp_path / "ready0", tmp_path / "ready1"])
        # the server's command line names the script, as the ranks' (forked from it) do
        processes = [p for p in _job_processes(str(script)) if p != launcher.pid]
        servers = [p for p in processes if b"lockstep.launcher.prefork" in Path(f"/proc/{p}/cmdline").read_bytes()]
        ranks = [int((tmp_path / f"ready{r}").read_text()) for r in range(2)]
        assert set(ranks) < set(servers), servers  # the ranks show the server's command line
        assert len(servers) == 3, servers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        assert not wait_gone(processes)
    finally:
        for pid in _job_processes(str(script)):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_a_restart_forks_its_ranks_from_the_server_the_first_attempt_had(tmp_path: Path, write_script) -> None:
    # The teardown between attempts spares the server, so a restart imports torch no more.
    script = write_script("restarted.py", textwrap.dedent("""
        import os, sys, time
        import torch
        launcher = os.getppid()

        def is_server(p):
            try:
                return (open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(launcher)
                        and b"lockstep.launcher.prefork" in open(f"/proc/{p}/cmdline", "rb").read())
            except OSError:  # the process ended while we looked: not ours (ours wait for us)
                return False

        servers = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and is_server(p)]
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        with open(os.path.join(sys.argv[1], f"seen{attempt}-{os.environ['RANK']}.tmp"), "w") as f:
            f.write(" ".join(map(str, [os.getpid(), *servers])))
        os.rename(f.name, f.name[:-4])
        # the first rank to fail tears the attempt down: each waits until both have written
        other = os.path.join(sys.argv[1], f"seen{attempt}-{1 - int(os.environ['RANK'])}")
        while not os.path.exists(other):
            time.sleep(0.01)
        sys.exit(3 if attempt == "0" else 0)
    """))
    result = launch(["-n", "2", "--max_restarts", "1", str(script), str(tmp_path)], cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stderr
    seen = [(tmp_path / f"seen{a}-{r}").read_text().split() for a in range(2) for r in range(2)]
    ranks = {own for own, *_ in seen}  # the ranks show the server's command line too
    servers = [set(others) - ranks for _, *others in seen]
    assert len(ranks) == 4 and servers[0] == servers[1] == servers[2] == servers[3] and len(servers[0]) == 1, seen


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or torch_version.cuda is not None,
                    reason="needs DeepSpeed and a CPU build of torch")
def test_plus_deepspeed_forks_ranks_that_find_it_imported_as_the_trainer_imports_it(
        tmp_path: Path, write_script) -> None:
    script = write_script("ds.py", textwrap.dedent("""
        import json, os, sys
        found = ["deepspeed" in sys.modules, "mlflow" in sys.modules]
        import torch
        from lockstep import Trainer
        from tests.trainer.common import MLP, loader, sgd
        model = MLP()
        Trainer(model=model, train_dataloader=loader(4), max_duration="2ba", optimizers=sgd(model),
                progress_bar=False, deepspeed_config={"zero_optimization": {"stage": 2}}).fit()
        with open(os.path.join(sys.argv[1], "found" + os.environ["RANK"]), "w") as f:
            json.dump(found, f)
    """))
    result = launch(["-n", "2", str(script), str(tmp_path)], cwd=tmp_path, timeout=110,
                    env={"LOCKSTEP_PREFORK": "+deepspeed", "PYTHONPATH": str(Path(__file__).parents[2])})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [json.loads((tmp_path / f"found{r}").read_text()) for r in range(2)] == [[True, False]] * 2


RACE = textwrap.dedent("""
    import ctypes, os, socket, sys, time
    from lockstep.launcher import prefork
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: this process plays the launcher
    fork, forks = os.fork, []

    def late_rank():
        # as on a loaded machine: the rank (the middle process's child) first runs once the middle is gone
        pid = fork()
        forks.append(pid)
        if pid == 0 and len(forks) == 2:
            time.sleep(0.3)
        return pid

    os.fork = late_rank
    ours, theirs = socket.socketpair()
    _, watchdog = os.pipe()
    request = {"targets": [], "ignored": [], "cwd": os.getcwd(), "env": dict(os.environ)}
    for _ in range(int(sys.argv[1])):
        forks.clear()
        forked = time.monotonic()
        if prefork._fork_rank(ours, watchdog, request, []) is None:  # the rank, once adopted
            print(f"{os.getppid()} {time.monotonic() - forked:.3f}", flush=True)
            os._exit(0)
        os.wait()
    print(f"launcher {os.getpid()}", flush=True)
""")


def test_a_rank_that_first_runs_after_its_middle_process_exited_starts_at_once(tmp_path: Path) -> None:
    """A rank forked by the server waits until its middle process is gone, so that the launcher is
    its parent from its first line. When the middle has exited before the rank first runs (as on a
    loaded machine), the rank is already the launcher's and goes on at once, rather than waiting
    10 s for an adoption that has happened (it did in about one launch of three on two cores)."""
    script = tmp_path / "race.py"
    script.write_text(RACE)
    done = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    *ranks, launcher = done.stdout.splitlines()
    parent = launcher.split()[1]
    assert len(ranks) == 2 and all(line.split()[0] == parent for line in ranks), done.stdout
    assert max(float(line.split()[1]) for line in ranks) < 5, done.stdout  # 0.3 s late, not the wait's 10 s
