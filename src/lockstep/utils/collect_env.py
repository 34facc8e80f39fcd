"""Composer's ``composer.utils.collect_env``: what the run ran on (``get_composer_env_dict``, kept
in each ``state_dict()``'s metadata), and the environment report printed with an uncaught
exception, which :func:`disable_env_report` turns off."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from lockstep.core.state_dict import environment

__all__ = ["disable_env_report", "enable_env_report", "get_composer_env_dict", "print_env"]

_report = {"on": True}


def get_composer_env_dict() -> dict[str, Any]:
    """The lockstep version, the CPU, and the nodes and GPUs of the run, under Composer's keys."""
    return environment()


def print_env(file: Any = None) -> None:
    """Print the environment: Python, torch, lockstep and the run's devices."""
    out = file or sys.stdout
    print(f"python {platform.python_version()}, torch {torch.__version__}", file=out)
    for name, value in get_composer_env_dict().items():
        print(f"{name}: {value}", file=out)


def enable_env_report() -> None:
    """Print :func:`print_env` with an uncaught exception (the default)."""
    _report["on"] = True


def disable_env_report() -> None:
    """Do not print the environment with an uncaught exception."""
    _report["on"] = False
