"""Checkpoint files: atomic writes, the latest pointer, verification, weights_only loading."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint import files
from lockstep.checkpoint.files import CheckpointError


def save(obj, path: Path) -> None:
    """What the saver does: write a temporary file beside ``path``, then publish it."""
    files.publish(files.write_temp(obj, path), path)


def test_publish_leaves_only_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ck.pt"
    save({"w": torch.arange(4)}, path)
    assert os.listdir(path.parent) == ["ck.pt"]
    assert torch.equal(files.read(path)["w"], torch.arange(4))


def test_failed_save_leaves_previous_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    save({"w": torch.zeros(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save({"w": Unpicklable()}, path)
    assert os.listdir(tmp_path) == ["ck.pt"]
    assert torch.equal(files.read(path)["w"], torch.zeros(2))


def test_latest_pointer_is_a_relative_symlink_replaced_atomically(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    save({"x": torch.ones(1)}, a)
    save({"x": torch.zeros(1)}, b)
    latest = tmp_path / "latest.pt"
    files.point_latest(latest, a)
    files.point_latest(latest, b)
    assert os.readlink(latest) == "b.pt"
    assert files.resolve_pointer(latest) == b
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt", "latest.pt"]
    b.unlink()
    with pytest.raises(CheckpointError, match="latest.pt names .*b.pt, which does not exist"):
        files.resolve_pointer(latest)


def test_truncated_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    save({"w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"ck\.pt is truncated or not a torch checkpoint"):
        files.read(path)


def test_corrupt_tensor_bytes_are_caught_by_crc(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    save({"w": torch.randn(10000)}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # torch.load alone would return silently wrong weights
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ck\.pt is corrupt: record .* fails its CRC check"):
        files.read(path)


def test_missing_and_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        files.read(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a folder"):
        files.read(tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_arbitrary_pickle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"payload": _Evil()}, path)
    with pytest.raises(CheckpointError, match=r"cannot load checkpoint .*evil\.pt with weights_only=True"):
        files.read(path)


def test_not_a_zip(tmp_path: Path) -> None:
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="truncated or not a torch checkpoint"):
        files.read(path)


def test_stale_temps_of_dead_writers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f".ck.pt.tmp.{dead}"
    live = tmp_path / f".ck.pt.tmp.{os.getppid()}"
    stale.write_bytes(b"half")
    live.write_bytes(b"someone else's write in progress")
    files.remove_stale_temps(tmp_path)
    assert not stale.exists() and live.exists()


@pytest.mark.timeout(60)
def test_kill_9_between_write_and_rename_keeps_previous_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal, torch
        from pathlib import Path
        from lockstep.checkpoint import files
        folder = Path({str(tmp_path)!r})
        def save(obj, path):
            files.publish(files.write_temp(obj, path), path)
        save({{"step": torch.tensor(1)}}, folder / "ba1.pt")
        files.point_latest(folder / "latest.pt", folder / "ba1.pt")
        files._before_publish = lambda path: os.kill(os.getpid(), signal.SIGKILL)
        save({{"step": torch.tensor(2)}}, folder / "ba2.pt")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert proc.returncode == -9, proc.stderr
    assert not (tmp_path / "ba2.pt").exists()
    assert int(files.read(files.resolve_pointer(tmp_path / "latest.pt"))["step"]) == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1  # the dead writer's temp file: ignored, and removed by the next save
    files.remove_stale_temps(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ba1.pt", "latest.pt"]


def test_crc_shares_cover_every_record_once(tmp_path: Path) -> None:
    import zipfile
    path = tmp_path / "ck.pt"
    save({f"w{i}": torch.randn(100 * (i + 1)) for i in range(7)}, path)
    with zipfile.ZipFile(path) as archive:
        records = archive.infolist()
    parts = [files._part(records, i, 3) for i in range(3)]
    names = [r.filename for part in parts for r in part]
    assert sorted(names) == sorted(r.filename for r in records)
    sizes = [sum(r.compress_size for r in part) for part in parts]
    assert max(sizes) - min(sizes) <= max(r.compress_size for r in records)
    data = bytearray(path.read_bytes())
    record = parts[2][0]  # corrupt a record only the third share checks
    data[record.header_offset + 30 + len(record.filename.encode()) + 70] ^= 0xFF
    path.write_bytes(bytes(data))
    files.verify(path, (0, 3))
    files.verify(path, (1, 3))
    with pytest.raises(CheckpointError, match=f"record {record.filename} fails its CRC check"):
        files.verify(path, (2, 3))
