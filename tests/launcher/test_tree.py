"""The launcher's view of a job's processes (lockstep.launcher.tree): a process whose main thread
has ended while another of its threads still runs is live, however its main thread shows."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.launcher.tree import job_processes, kill_job
from tests.launcher.conftest import pid_alive

pytestmark = pytest.mark.timeout(60)

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
