"""What a killed job left in a staging folder: removed when the next job starts, published checkpoints
and other runs' names kept. Real files, one process."""

from __future__ import annotations

from pathlib import Path

from lockstep.checkpoint import leftovers


def test_sweep_removes_this_runs_unfinished_names_and_nothing_else(tmp_path: Path) -> None:
    globs = ["ep*-ba*-rank0.pt", "latest-rank0.pt"]
    gone = [tmp_path / ".ep0-ba8-rank0.pt.tmp.123" / "__1_0.distcp",  # a folder being written
            tmp_path / ".ep0-ba4-rank0.pt-replaced.tmp.77" / "lockstep.pt",  # moved aside by a publish
            tmp_path / ".latest-rank0.pt.tmp.5",  # a pointer being replaced
            tmp_path / "ep0-ba4-rank0.pt" / f"__0_0.distcp.{'c' * 32}.tmp",  # downloads under way
            tmp_path / "ep0-ba4-rank0.pt" / "deepspeed" / f"x.pt.{'d' * 32}.tmp.0aB1c2D3",
            tmp_path / "ep0-ba4-rank0.pt" / ".lockstep.pt.tmp.9"]
    kept = [tmp_path / "ep0-ba4-rank0.pt" / "lockstep.pt", tmp_path / "ep0-ba4-rank0.pt" / "__0_0.distcp",
            tmp_path / ".other-run-ba4.pt.tmp.123",  # another run's name
            tmp_path / f"notes.txt.{'e' * 32}.tmp",
            tmp_path / ".uploading" / "rank1" / ".ep0-ba4-rank0.pt.tmp.1",  # the uploader's own
            tmp_path / ".lockstep-claim.job.rank0"]
    for path in gone + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    removed = leftovers.sweep(tmp_path, globs)
    assert not any(p.exists() for p in gone)
    assert all(p.exists() for p in kept)
    assert len(removed) == 6
    assert leftovers.sweep(tmp_path / "absent", globs) == []
