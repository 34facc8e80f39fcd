"""Issue 53: a configuration error is one line for the job, without a traceback unless asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lockstep import errors
from lockstep.time import time_argument

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)

BAD = textwrap.dedent("""
    import sys
    from lockstep import Callback, Trainer
    from tests.trainer.common import MLP, loader, sgd

    class Raises(Callback):
        def init(self, state, logger):
            raise ValueError("the user's own check")

    model = MLP()
    how = sys.argv[1] if sys.argv[1:] else "init"
    extra = {"callbacks": [Raises()]} if how == "user" else {"max_duration": "3 bananas"} if how == "init" else {}
    trainer = Trainer(model=model, train_dataloader=loader(8), optimizers=sgd(model), progress_bar=False,
                      **{"max_duration": "1ep", **extra})
    trainer.fit(duration="3 bananas")
""")
LINE = "lockstep: error: max_duration='3 bananas': invalid duration '3 bananas': expected a number"


def _run(tmp_path: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "bad.py"
    script.write_text(BAD)
    return subprocess.run([sys.executable, *[str(script) if a == "SCRIPT" else a for a in argv]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})


def test_a_script_s_configuration_error_is_one_line(tmp_path: Path) -> None:
    done = _run(tmp_path, ["SCRIPT"])
    assert done.returncode == 1 and done.stderr.startswith(LINE) and done.stderr.count("\n") == 1, done.stderr
    shown = _run(tmp_path, ["SCRIPT"], LOCKSTEP_VERBOSE="1")
    assert "Traceback (most recent call last)" in shown.stderr and "ValueError: max_duration=" in shown.stderr


def test_under_the_launcher_it_is_one_line_for_the_job_and_no_restart(tmp_path: Path) -> None:
    done = _run(tmp_path, ["-m", "lockstep", "-n", "2", "--max_restarts", "2", "SCRIPT"])
    assert done.returncode == 1 and done.stderr.startswith(LINE) and done.stderr.count("\n") == 1, done.stderr
    shown = _run(tmp_path, ["-m", "lockstep", "-v", "-n", "2", "SCRIPT"])
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr
    assert "failed first with exit code 1" in shown.stderr


def test_fit_s_arguments_are_checked_as_the_trainer_s(tmp_path: Path) -> None:
    done = _run(tmp_path, ["-m", "lockstep", "-n", "2", "--max_restarts", "2", "SCRIPT", "fit"])
    line = "lockstep: error: duration='3 bananas': invalid duration '3 bananas'"
    assert done.returncode == 1 and done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr


def test_an_error_raised_by_the_user_s_code_keeps_its_traceback(tmp_path: Path) -> None:
    done = _run(tmp_path, ["SCRIPT", "user"])
    assert "Traceback (most recent call last)" in done.stderr and "ValueError: the user's own check" in done.stderr


def test_only_lockstep_s_own_raise_statements_are_marked() -> None:
    with pytest.raises(ValueError) as ours, errors.configuration_checks():
        time_argument("max_duration", "3 bananas")
    assert errors.is_configuration_error(ours.value)

    def user_code() -> None:
        raise ValueError("not lockstep's")

    with pytest.raises(ValueError) as theirs, errors.configuration_checks():
        user_code()
    assert not errors.is_configuration_error(theirs.value)
    from lockstep.core.eval_metrics import value_of

    with pytest.raises(ValueError) as python_s, errors.configuration_checks():
        value_of("not a number")  # float() raises inside lockstep: a bug's kind, whose traceback matters
    assert not errors.is_configuration_error(python_s.value)
