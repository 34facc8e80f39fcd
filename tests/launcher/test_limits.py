"""The launcher's open-file limit against the ranks asked for (issue 37: -n 100000 ran for 44 s and
left 19,991 empty log files)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lockstep.launcher.cli import parse_plan
from lockstep.launcher.limits import check_open_files, open_files_needed
from lockstep.launcher.plan import LaunchError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "ran.py"
    path.write_text("open('ran', 'w').write('yes')\n")
    return str(path)


def test_open_files_count_log_files_pipes_pidfds_and_progress_slots(script: str) -> None:
    # local rank 0: console only (pidfd, slot); rank 1: two log files too; --tee adds a pipe per stream
    base = open_files_needed(parse_plan(["-n", "1", script], env={}))
    assert open_files_needed(parse_plan(["-n", "2", script], env={})) == base + 4
    assert open_files_needed(parse_plan(["-n", "2", "--tee", "3", script], env={})) == base + 4 + 6


def test_too_many_ranks_for_the_open_file_limit_is_one_line_saying_what_to_change(script: str) -> None:
    plan = parse_plan(["-n", "300", script], env={})
    need = open_files_needed(plan)
    check_open_files(plan, (need, need))
    with pytest.raises(LaunchError) as info:
        check_open_files(plan, (1024, 4096))
    assert str(info.value) == (f"-n 300 needs about {need} open files in the launcher, more than its limit of "
                               f"1024 (ulimit -n): lower -n, or raise the limit with ulimit -n {need} before "
                               f"starting lockstep")
    with pytest.raises(LaunchError, match=r"lower -n: even the hard limit \(ulimit -Hn\) is 1024$"):
        check_open_files(plan, (1024, 1024))


def _limit_open_files(soft: int) -> Callable[[], None]:
    """A preexec_fn that lowers the child's own open-file limit (its hard limit stays)."""
    def limit() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return limit


def test_a_hundred_thousand_ranks_are_refused_before_any_file_or_process(tmp_path: Path, script: str) -> None:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "lockstep", "-n", "100000", script], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=60, preexec_fn=_limit_open_files(1024))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "-n 100000 needs about" in result.stderr and "limit of 1024 (ulimit -n)" in result.stderr
    assert time.monotonic() - start < 10
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ran").exists()
