"""No process of a job outlives it, however the ranks' descendants group themselves (issue 49).

Each rank starts three sleepers that leave its process group: one in a session of its own, one in
a group of its own without the launcher's mark in its environment, and one whose parent exits at
once (a daemon's double fork), so it is orphaned while the job runs. Then the rank is killed, or
the launcher is stopped or killed, and every process of the job must be gone soon after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launcher.conftest import wait_for_files, wait_gone

pytestmark = pytest.mark.timeout(120)

SLEEPER = "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); " \
          "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)"

RANK = textwrap.dedent("""
    import os, subprocess, sys, time
    folder, sleeper, kinds = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    path = lambda kind: os.path.join(folder, kind + os.environ["RANK"])
    bare = {k: v for k, v in os.environ.items() if k != "LOCKSTEP_TREE"}  # without the launcher's mark

    def daemon(kind, env):  # started by a parent that exits at once
        code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleeper!r}, {path(kind)!r}], " \\
               f"start_new_session=True)"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)

    subprocess.Popen([sys.executable, "-c", sleeper, path("session")], start_new_session=True)
    subprocess.Popen([sys.executable, "-c", sleeper, path("group")], process_group=0, env=bare)
    daemon("daemon", os.environ)
    if "orphan" in kinds:
        daemon("orphan", bare)
    while not all(os.path.exists(path(k)) for k in kinds if k != "rank"):
        time.sleep(0.02)
    open(os.path.join(folder, "control"), "w").write(os.environ["LOCKSTEP_CONTROL_DIR"])
    open(path("rank") + ".tmp", "w").write(str(os.getpid()))
    os.rename(path("rank") + ".tmp", path("rank"))
    time.sleep(120)
""")

KINDS = ("rank", "session", "group", "daemon")
"""A rank, and what it starts: in a session of its own; in a group of its own without the launcher's
mark; in a session of its own by a parent that exits at once, so the sleeper is orphaned."""
ORPHAN = "orphan"
"""Orphaned as "daemon", and without the launcher's mark: only the launcher, as its subreaper, finds it."""


class Job:
    """A launcher with two ranks whose sleepers have all started, and every pid of the job by name."""

    def __init__(self, folder: Path, script: Path, kinds: tuple[str, ...]) -> None:
        self.err = folder / "launcher.err"
        # Files, not pipes: a leftover sleeper would hold a pipe open, and the test would wait on it.
        with open(folder / "launcher.out", "w") as out, open(self.err, "w") as err:
            self.launcher = subprocess.Popen(
                [sys.executable, "-m", "lockstep", "-n", "2", "--grace_period", "2", str(script), str(folder), SLEEPER,
                 ",".join(kinds)],
                cwd=folder, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=err)
        files = [folder / f"{kind}{r}" for kind in kinds for r in range(2)]
        wait_for_files(files)
        self.pids = {f.name: int(f.read_text()) for f in files}

    def wait(self, timeout: float) -> tuple[int, str]:
        """The launcher's exit code and what it printed on stderr."""
        return self.launcher.wait(timeout=timeout), self.err.read_text()


@pytest.fixture
def job(request: pytest.FixtureRequest, tmp_path: Path, write_script) -> Iterator[Job]:
    script = write_script("rank.py", RANK)
    started: list[Job] = []
    try:
        started.append(Job(tmp_path, script, getattr(request, "param", KINDS)))
        yield started[0]
    finally:
        if started and started[0].launcher.poll() is None:
            started[0].launcher.kill()
            started[0].launcher.wait(timeout=30)
        _kill_leftovers(tmp_path)


def _kill_leftovers(folder: Path) -> None:
    """SIGKILL what a failed test left: processes whose command line names the test's folder."""
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and str(folder).encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass


def _alive(pids: dict[str, int], timeout: float) -> list[str]:
    left = set(wait_gone(list(pids.values()), timeout=timeout))
    return [name for name, pid in pids.items() if pid in left]


@pytest.mark.parametrize("job", [(*KINDS, ORPHAN)], indirect=True)
def test_sigkill_of_a_rank_leaves_none_of_its_descendants(job: Job) -> None:
    os.kill(job.pids["rank0"], signal.SIGKILL)
    code, err = job.wait(timeout=60)
    assert code == 128 + signal.SIGKILL, err
    assert "rank 0" in err and "signal SIGKILL" in err, err
    assert _alive(job.pids, timeout=3) == []  # killed by the teardown, before the launcher exited


@pytest.mark.parametrize("job", [(*KINDS, ORPHAN)], indirect=True)
def test_sigterm_to_the_launcher_leaves_none_of_the_ranks_descendants(job: Job) -> None:
    job.launcher.send_signal(signal.SIGTERM)
    code, err = job.wait(timeout=60)
    assert code == 128 + signal.SIGTERM, err
    assert _alive(job.pids, timeout=3) == []


def test_sigkill_of_the_launcher_leaves_none_of_the_ranks_descendants(job: Job) -> None:
    job.launcher.kill()
    job.wait(timeout=30)
    # the watchdog's work; an orphan without the mark is out of its reach (docs/launcher.md)
    assert _alive(job.pids, timeout=10) == []
    control = Path((job.err.parent / "control").read_text())  # the ranks' progress files, in /dev/shm
    assert control.name.startswith("lockstep-"), control
    deadline = time.monotonic() + 10
    while control.exists() and time.monotonic() < deadline:  # the watchdog removes it once it killed the job
        time.sleep(0.05)
    assert not control.exists(), sorted(p.name for p in control.iterdir())



def test_an_orphan_that_exits_while_the_job_runs_leaves_no_zombie(tmp_path: Path, write_script) -> None:
    """The launcher adopts orphans as their subreaper, so it collects their exits too, as they come:
    a rank that runs ``cmd &`` through a shell every step must not fill the pid table with zombies."""
    script = write_script("shell.py", textwrap.dedent("""
        import os, subprocess, sys, time
        folder = sys.argv[1]
        subprocess.run(["sh", "-c", "sleep 0.2 >/dev/null 2>&1 & echo $! > orphan.tmp && mv orphan.tmp orphan"],
                       cwd=folder, check=True)
        while not os.path.exists(os.path.join(folder, "done")):
            time.sleep(0.05)
    """))
    launcher = subprocess.Popen([sys.executable, "-m", "lockstep", "-n", "1", str(script), str(tmp_path)],
                                cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_files([tmp_path / "orphan"])
        orphan = int((tmp_path / "orphan").read_text())
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{orphan}"), Path(f"/proc/{orphan}/stat").read_text()
        (tmp_path / "done").write_text("")
        assert launcher.wait(timeout=30) == 0
    finally:
        (tmp_path / "done").write_text("")
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(timeout=30)
