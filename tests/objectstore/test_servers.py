"""The servers the tests start die with the process that started them, even when it is killed (a
test run stopped from outside, as CI's time limit stops one): none is left to init."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.conftest import wait_gone

HERE = Path(__file__).resolve().parent
STARTS = {"s3": "seaweed.start()", "gs": "emulators.start_fake_gcs()", "azure": "emulators.start_azurite()"}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scheme", list(STARTS))
def test_a_server_dies_with_the_process_that_started_it(scheme: str) -> None:
    script = (f"import sys, time; sys.path.insert(0, {str(HERE)!r}); import emulators, seaweed\n"
              f"server = {STARTS[scheme]}\nprint(server.process.pid, server.folder, flush=True)\ntime.sleep(600)\n")
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    folder = None
    try:
        line = starter.stdout.readline()
        pid, _, folder = line.strip().partition(" ")
        assert pid.isdigit(), f"the server did not start: {line!r}"
        server = int(pid)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        assert not wait_gone([server], timeout=10), f"the {scheme} server outlived its starter"
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        if folder:  # its files: the starter, killed, could not remove them
            shutil.rmtree(folder, ignore_errors=True)
