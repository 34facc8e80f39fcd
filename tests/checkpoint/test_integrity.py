"""A checkpoint folder's parts: recorded sizes and CRC32s, checked against real damage to real files,
and a DCP folder saved without records checked through its ``.metadata``. One process, no Trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep.checkpoint import integrity
from lockstep.checkpoint.files import DamagedCheckpoint
from tests.trainer.common import damage


def _dcp_folder(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    tensors = {"model": {f"w{i}": torch.randn(64 * (i + 1)) for i in range(4)}}
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=False)  # a file per tensor
    dcp.save(tensors, storage_writer=writer, no_dist=True)
    return folder


def _parts(folder: Path) -> dict[str, list[int]]:
    return integrity.record(folder, [p.name for p in folder.iterdir()])


def test_intact_parts_pass_and_every_share_is_checked_once(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ck")
    parts = _parts(folder)
    assert len(parts) == 5 and all(size == (folder / n).stat().st_size for n, (size, _) in parts.items())
    for i in range(3):
        integrity.check_parts(folder, parts, (i, 3))
    integrity.check_dcp_files(folder)
    shares = [integrity.share({n: s for n, (s, _) in parts.items()}, i, 3) for i in range(3)]
    assert sorted(n for share in shares for n in share) == sorted(parts)


@pytest.mark.parametrize("how, says", [
    ("delete", r"__0_1\.distcp is missing \(deleted\?\)"),
    ("truncate", r"__0_1\.distcp is \d+ bytes, expected \d+ \(truncated\?\)"),
    ("flip", r"__0_1\.distcp fails its CRC32 check \(flipped bytes\?\)"),
], ids=["delete", "truncate", "flip"])
def test_damage_is_named_by_the_rank_whose_share_holds_it(tmp_path: Path, how: str, says: str) -> None:
    folder = _dcp_folder(tmp_path / "ck")
    parts = _parts(folder)
    damage(folder / "__0_1.distcp", how)
    mine = next(i for i in range(3) if "__0_1.distcp" in integrity.share({n: s for n, (s, _) in parts.items()}, i, 3))
    with pytest.raises(DamagedCheckpoint, match=rf"^checkpoint {folder} is damaged: {says}: load an older "
                                                rf"checkpoint or delete this one$"):
        integrity.check_parts(folder, parts, (mine, 3))
    if how == "flip":  # the other ranks check only sizes of it: theirs pass, and the loader agrees on the failure
        for other in {0, 1, 2} - {mine}:
            integrity.check_parts(folder, parts, (other, 3))


@pytest.mark.parametrize("target, how, says", [
    ("__0_2.distcp", "delete", r"__0_2\.distcp is missing \(deleted\?\)"),
    ("__0_2.distcp", "truncate", r"__0_2\.distcp is \d+ bytes, expected at least \d+ \(truncated\?\)"),
    (".metadata", "delete", r"\.metadata is missing \(deleted\?\)"),
    (".metadata", "truncate", r"\.metadata does not load \(.*; truncated or flipped bytes\?\)"),
], ids=["delete-distcp", "truncate-distcp", "delete-metadata", "truncate-metadata"])
def test_a_folder_saved_without_records_is_checked_through_its_metadata(tmp_path: Path, target: str, how: str,
                                                                        says: str) -> None:
    folder = _dcp_folder(tmp_path / "ck")
    damage(folder / target, how)
    with pytest.raises(DamagedCheckpoint, match=rf"^checkpoint {folder} is damaged: {says}: load an older "):
        integrity.check_sharded(folder, {})


def test_recorded_reads_each_rank_checks_what_it_reads_each_part_once(tmp_path: Path) -> None:
    """A folder whose lockstep.pt records what each rank reads (as on nodes without a shared disk,
    each holding only its ranks' reads): each rank checks sizes of its reads only, so a part that
    only another rank reads may be absent; each part's CRC32 is checked by exactly one of its readers."""
    folder = _dcp_folder(tmp_path / "ck")
    parts = _parts(folder)
    names = sorted(parts)
    reads = [[names[0], names[1]], [names[0], names[2]], [names[0], names[3], names[4]]]
    meta = {"parts": parts, "reads": reads}
    sizes = {n: s for n, (s, _) in parts.items()}
    assigned = [integrity.assign(sizes, meta, rank, 3) for rank in range(3)]
    assert [sorted(reading) for reading, _ in assigned] == [sorted(r) for r in reads]
    checked = [n for _, turns in assigned for n in turns]
    assert sorted(checked) == names  # each part once
    assert all(n in reads[rank] for rank, (_, turns) in enumerate(assigned) for n in turns)
    assert integrity.reads_of(meta, 1, 3) == set(reads[1])
    assert integrity.reads_of(meta, 1, 4) is None  # another world size: every rank reads every part
    (folder / names[1]).unlink()  # only rank 0 reads it
    for rank in (1, 2):
        integrity.check_parts(folder, parts, (rank, 3), meta)
    with pytest.raises(DamagedCheckpoint, match=rf"{names[1]} is missing"):
        integrity.check_parts(folder, parts, (0, 3), meta)


def test_part_rank_names_each_ranks_own_files() -> None:
    assert integrity.part_rank("__3_0.distcp") == 3
    assert integrity.part_rank("deepspeed/zero_pp_rank_2_mp_rank_00_optim_states.pt") == 2
    assert [integrity.part_rank(n) for n in (".metadata", "lockstep.pt", "deepspeed/mp_rank_00_model_states.pt")] \
        == [None, None, None]


def test_each_copy_of_a_part_is_checked_once_by_the_ranks_that_read_that_copy() -> None:
    """Ranks 0, 1 on one disk and 2, 3 on another: every part that both nodes read is checked on
    each node's copy, by one of that node's readers; with one shared copy, once in all."""
    reads = [[".metadata", "__0_0.distcp"], [".metadata", "__1_0.distcp"],
             [".metadata", "__2_0.distcp"], [".metadata", "__3_0.distcp", "__0_0.distcp"]]
    meta = {"reads": reads}
    sizes = {name: 10 for name in {n for r in reads for n in r}}
    nodes = [[0, 1], [2, 3]]
    for node in nodes:
        turns = [n for rank in node for n in integrity.assign(sizes, meta, rank, 4, node)[1]]
        assert sorted(turns) == sorted({n for rank in node for n in reads[rank]})  # each of the node's reads once
    shared = [n for rank in range(4) for n in integrity.assign(sizes, meta, rank, 4)[1]]
    assert sorted(shared) == sorted(sizes)
    unrecorded = {}  # without recorded reads every rank reads every part; each node checks its copy
    for node in nodes:
        turns = [n for rank in node for n in integrity.assign(sizes, unrecorded, rank, 4, node)[1]]
        assert sorted(turns) == sorted(sizes)
    assert integrity.within((3, 4), [2, 3]) == (1, 2) and integrity.within((3, 4), None) == (3, 4)
