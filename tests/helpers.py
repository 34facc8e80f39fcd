"""Helpers the tests share: free ports, bitwise comparison of parameters, a Trainer's weights, and
reference runs made once for every pytest-xdist worker."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(argv: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of ``lockstep ARGV``: this process's, one OpenMP thread a rank, ``env``, and
    ``LOCKSTEP_PREFORK=+...`` for what a test job imports only as it trains, so that its ranks fork
    with it imported once (~3 s of CPU less a rank): DeepSpeed for a job that trains under it
    (``--zero STAGE``, or ``zero2`` among its ``--layouts``), torchmetrics for the elastic job's
    metrics (``--eval``, ``--train-accuracy``)."""
    layouts = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--layouts"]
    preload = [name for name, wanted in (
        ("deepspeed", "--zero" in argv or any("zero" in value for value in layouts)),
        ("torchmetrics", "--eval" in argv or "--train-accuracy" in argv)) if wanted]
    forking = {"LOCKSTEP_PREFORK": "+" + ",".join(preload)} if preload else {}
    return {**os.environ, "OMP_NUM_THREADS": "1", **forking, **(env or {})}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same names, and every tensor equal bit for bit."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], T]) -> T:
    """``make(folder)``'s result, made once per test session however many workers (``-n``) ask for
    it: the first makes it in a folder of the session's temporary directory while the others wait,
    then each reads the saved result. For the uninterrupted runs that tests compare with, which
    every worker would otherwise train again. A ``make`` that raises saves nothing."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own
    folder = root / f"shared-{name}"
    folder.mkdir(exist_ok=True)
    saved = folder / "result.pt"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            shutil.rmtree(folder / "run", ignore_errors=True)  # what a make that failed left
            value = make(folder / "run")
            torch.save(value, folder / "result.pt.tmp")
            os.replace(folder / "result.pt.tmp", saved)
    return torch.load(saved, weights_only=False)


def trainer_params(trainer: Any) -> dict[str, torch.Tensor]:
    """A copy of the Trainer's model state, to compare after it trains on."""
    return {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items()}
