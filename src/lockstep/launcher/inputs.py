"""Checks of what the command line names on disk, made before anything starts.

Each failure is a LaunchError whose one line names the argument and the fix. Nothing here creates
a file or folder: paths are judged by what exists (the supervisor still reports, the same way, a
path that only fails when it is created).
"""

from __future__ import annotations

import codecs
import importlib.util
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

from lockstep.launcher.plan import FORMAT_FIELDS, LaunchError, LaunchPlan, Mode

_HEAD = 1024
# PEP 263: a coding declaration on the first or second line lets a script use another encoding.
_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*[-\w.]+", re.MULTILINE)


def check_format(name: str, fmt: str | None) -> None:
    """--stdout/--stderr must format with lockstep's fields only."""
    if fmt is None:
        return
    try:
        fmt.format(**{f: 0 for f in FORMAT_FIELDS})
    except (KeyError, IndexError, ValueError) as e:
        fields = ", ".join("{%s}" % f for f in FORMAT_FIELDS)
        raise LaunchError(f"--{name} {fmt!r} is not a valid format: {e}; use only {fields}") from None


def check_target(mode: Mode, target: str) -> None:
    """The script, module or command exists (and a script is Python source)."""
    if mode is Mode.SCRIPT:
        _check_script(target)
    if mode is Mode.COMMAND and shutil.which(target) is None:
        raise LaunchError(f"command {target!r} was not found on PATH or is not executable")
    if mode is Mode.MODULE:
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise LaunchError(f"module {target!r} was not found (run from the folder that contains it)")


def _check_script(target: str) -> None:
    path = Path(target)
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            scripts = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
            example = scripts[0] if scripts else path / "train.py"
            raise LaunchError(f"training script {target!r} is a directory: pass the script to run, e.g. "
                              f"{example} (a directory runs only if it has a __main__.py)")
        path = path / "__main__.py"  # as `python FOLDER`: the worker bootstrap runs it the same way
    elif not path.is_file():
        raise LaunchError(f"training script {target!r} does not exist (use -m for a module, -c for a command)")
    _check_source(str(path))


def _check_source(target: str) -> None:
    """A binary file would fail on every rank with a SyntaxError; say so once instead."""
    try:
        with open(target, "rb") as f:
            head = f.read(_HEAD)
    except OSError as e:
        raise LaunchError(f"training script {target!r} cannot be read ({e.strerror})") from None
    if zipfile.is_zipfile(target):
        return  # python runs a zip archive's __main__.py, and so does the worker bootstrap
    if b"\0" in head:
        raise LaunchError(f"training script {target!r} is a binary file, not Python source: "
                          f"run a program with -c/--no-python")
    if _CODING.search(b"\n".join(head.split(b"\n")[:2])):
        return
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise LaunchError(f"training script {target!r} is not UTF-8 text (byte {head[e.start]:#04x} at "
                          f"offset {e.start}): save it as UTF-8, declare its encoding, or run a "
                          f"program with -c/--no-python") from None


def check_paths(plan: LaunchPlan) -> None:
    """The run directory and every rank's log file can be created and written."""
    why = _unwritable(plan.run_directory, folder=True)
    if why:
        raise LaunchError(f"--run_directory {str(plan.run_directory)!r} {why}: pass a folder you can write to")
    for spec in plan.ranks:
        for flag, path in (("--stdout", spec.stdout_path), ("--stderr", spec.stderr_path)):
            why = _unwritable(path, folder=False) if path is not None else None
            if why:
                raise LaunchError(f"{flag}: rank {spec.rank}'s log file {str(path)!r} {why}: "
                                  f"pass a writable path")


def _unwritable(path: Path, folder: bool) -> str | None:
    """Why ``path`` cannot be written (as a folder or a file), judged without creating it."""
    try:
        if path.exists():
            if path.is_dir() != folder:
                return "is a folder" if path.is_dir() else "is a file, not a folder"
            return None if os.access(path, os.W_OK) else "is not writable"
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
    except OSError as e:
        return f"cannot be checked ({e.strerror})"
    if not parent.is_dir():
        return f"is under {str(parent)!r}, which is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {str(parent)!r} is not writable"
    return None
