"""The launcher's view of a job's processes (lockstep.launcher.tree): a process whose main thread
has ended while another of its threads still runs is live, however its main thread shows; a rank's
pid that another process took after the rank was gone is not the job's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.launcher.tree import job_processes, kill_job
from tests.launcher.conftest import pid_alive

pytestmark = pytest.mark.timeout(60)
SRC = Path(__file__).resolve().parents[2] / "src"

# The main thread ends (pthread_exit) while another thread sleeps on: the kernel shows the process
# as a zombie ("Zl") that still holds its files and their locks, as a killed rank whose writer
# thread sits in a long disk write does until the write returns.
HALF_ENDED = """
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
time.sleep(0.1)
ctypes.CDLL(None).pthread_exit(None)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_zombie_main_thread_with_a_live_thread_is_still_part_of_the_job() -> None:
    proc = subprocess.Popen([sys.executable, "-c", HALF_ENDED])
    try:
        deadline = time.monotonic() + 30
        while _state(proc.pid) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert len(list(Path(f"/proc/{proc.pid}/task").iterdir())) == 2
        assert proc.pid in job_processes(None, [proc.pid])
        assert pid_alive(proc.pid)
        assert kill_job(None, [proc.pid]) == set()  # killed, and waited for until its thread was gone too
        assert not pid_alive(proc.pid) and proc.pid not in job_processes(None, [proc.pid])
    finally:
        proc.kill()
        proc.wait()


# In a pid namespace of its own, where nothing else forks, a rank's pid is handed to an unrelated
# process (ns_last_pid) once the rank is gone: the launcher's end (its watchdog) and the signals
# the launcher sends to a rank it reaped must spare it, and still kill what is the job's.
REUSED = """
import fcntl, os, signal, subprocess, sys, termios, time
sys.path.insert(0, sys.argv[1])
from lockstep.launcher import tree
from lockstep.launcher.watchdog import Watchdog

def group_leader():  # as a rank: a process group of its own
    return subprocess.Popen(["sleep", "60"], process_group=0)

watchdog = Watchdog(tree.new_mark())
rank, mine = group_leader(), group_leader()
for proc in (rank, mine):
    watchdog.guard(proc.pid)
while int.from_bytes(fcntl.ioctl(watchdog.write_fd, termios.FIONREAD, bytes(4)), sys.byteorder):
    time.sleep(0.01)  # until the watchdog read both, as it does while a rank runs
time.sleep(0.2)
rank.kill()
rank.wait()  # reaped: its pid is free, and nothing else of the job holds its group
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(rank.pid - 1))
other = group_leader()
assert other.pid == rank.pid, (other.pid, rank.pid)
tree.signal_group(rank.pid, signal.SIGKILL, None)  # what a launcher sends a rank it reaped
watchdog.close()  # the launcher's end: the watchdog kills the groups it guards that are the job's
print("other", "alive" if other.poll() is None else f"killed {other.returncode}")
print("mine", "alive" if mine.poll() is None else f"killed {mine.returncode}")
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare (util-linux) and root")
def test_a_pid_taken_by_another_process_after_the_rank_was_gone_is_spared() -> None:
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", REUSED, str(SRC)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["other alive", "mine killed -9"], done.stdout
