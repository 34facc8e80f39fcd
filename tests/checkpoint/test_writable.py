"""save_folder is checked when the Trainer is built, and a failed write says why (disk full, ...)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lockstep import Trainer
from lockstep.checkpoint import writable
from tests.trainer.common import MLP, loader, sgd


def build(save_folder: Path) -> Trainer:
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), max_duration="2ep", optimizers=sgd(model),
                   save_folder=str(save_folder), progress_bar=False)


def test_a_save_folder_that_is_a_file_fails_at_construction(tmp_path: Path) -> None:
    target = tmp_path / "checkpoints"
    target.write_text("not a folder")
    with pytest.raises(ValueError, match=r"^save_folder .*checkpoints is a file, not a folder: pass a folder path$"):
        build(target)


def test_a_save_folder_below_a_file_fails_at_construction(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not writable: a part of the path is a file, not a folder"):
        build(tmp_path / "file" / "checkpoints")


def test_a_missing_save_folder_is_created_and_left_clean(tmp_path: Path) -> None:
    build(tmp_path / "a" / "b")
    # nothing but the live Trainer's claim on the folder (see test_ownership.py)
    left = [p.name for p in (tmp_path / "a" / "b").iterdir()]
    assert (tmp_path / "a" / "b").is_dir() and [n.startswith(".lockstep-claim.") for n in left] == [True], left


def test_explain_names_a_full_disk_from_torch_saves_message(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(writable, "free_bytes", lambda folder: 4096)
    cause = writable.explain(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 644288 "
                                          "vs 644176"), tmp_path)
    assert cause.startswith("no space left on device (4096 bytes free")
    monkeypatch.setattr(writable, "free_bytes", lambda folder: 10 << 30)
    assert "unexpected pos" in writable.explain(RuntimeError("unexpected pos 1 vs 2"), tmp_path)


# A real full disk and a real read-only file system: a 1 MiB tmpfs in a private mount namespace.
FULL_DISK_JOB = textwrap.dedent("""
    import os, subprocess, sys, torch
    from pathlib import Path
    from lockstep import Trainer
    from tests.trainer.common import MLP, loader, sgd

    folder = Path(sys.argv[1])
    class Big(MLP):  # a checkpoint of ~2.4 MB: does not fit on the 1 MiB file system
        def __init__(self):
            super().__init__()
            self.ballast = torch.nn.Parameter(torch.zeros(300_000), requires_grad=False)
    if sys.argv[2] == "full":
        model = Big()
        trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="1ep", optimizers=sgd(model),
                          save_folder=str(folder), progress_bar=False)
        try:
            trainer.fit()
        except RuntimeError as e:
            print("ERROR:", e)
        print("LEFT:", sorted(os.listdir(folder)))
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        try:
            model = MLP()
            Trainer(model=model, train_dataloader=loader(4), max_duration="1ep", optimizers=sgd(model),
                    save_folder=str(folder / "ck"), progress_bar=False)
        except ValueError as e:
            print("ERROR:", e)
""")


def _in_small_tmpfs(tmp_path: Path, mode: str) -> str:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "job.py"
    script.write_text(FULL_DISK_JOB)
    repo = Path(__file__).resolve().parents[2]
    inner = f"mount -t tmpfs -o size=1m none {mount} && exec {sys.executable} {script} {mount} {mode}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", inner], capture_output=True, text=True, timeout=120,
                          cwd=repo, env={"PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0 and "mount" in proc.stderr and "ERROR:" not in proc.stdout:
        pytest.skip(f"no private tmpfs here: {proc.stderr.strip()[:200]}")
    return proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_a_full_disk_is_named_and_leaves_no_partial_file(tmp_path: Path) -> None:
    out = _in_small_tmpfs(tmp_path, "full")
    assert "ERROR: writing a checkpoint in" in out and "no space left on device" in out, out
    assert "LEFT: []" in out, out  # no half-written temporary file, no pointer to a missing file


@pytest.mark.timeout(150)
def test_a_read_only_save_folder_fails_at_construction(tmp_path: Path) -> None:
    out = _in_small_tmpfs(tmp_path, "ro")
    assert "ERROR: save_folder" in out and "is not writable: read-only file system" in out, out
