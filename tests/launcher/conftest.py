"""Helpers for end-to-end launcher tests: run `python -m lockstep` as a real subprocess."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.launcher.tree import alive
from tests.helpers import launcher_env


def launch(args: list[str], cwd: Path, timeout: float = 90, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockstep", *args], cwd=cwd, env=launcher_env(args, env),
                          capture_output=True, text=True, timeout=timeout)


def pid_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie whose every thread has ended (the launcher's own
    rule, :func:`lockstep.launcher.tree.alive`)."""
    return alive(pid)


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def wait_for_files(paths: list[Path], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.stat().st_size > 0 for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not written in time: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)


@pytest.fixture
def write_script(tmp_path: Path):
    def write(name: str, body: str) -> Path:
        path = tmp_path / name
        path.write_text(body)
        return path
    return write


@pytest.fixture
def script(tmp_path: Path) -> str:
    """A script that prints a line, for the tests that parse a command line around it."""
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)
