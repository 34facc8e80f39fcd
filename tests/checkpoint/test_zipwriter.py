"""zipwriter.save writes what torch.save writes, CRC32s included, without touching torch's switch."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint import files, staging, zipwriter

SERIALIZATION_ID = ".data/serialization_id"  # random per file, whoever writes it


def _state() -> dict:
    torch.manual_seed(0)
    weight = torch.randn(300, 200)
    return {
        "weight": weight,
        "tied": weight[10:20],  # a view: its storage is written once
        "transposed": torch.randn(7, 5).t(),
        "half": torch.randn(33, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "ints": [torch.arange(10), "text", 3.5, {"nested": torch.ones(4, dtype=torch.int64)}],
    }


def _records(path: Path) -> dict[str, tuple[int, int, int, bytes]]:
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # zipfile checks every record's CRC32
        return {r.filename.split("/", 1)[1]: (r.header_offset, r.CRC, r.file_size, archive.read(r))
                for r in archive.infolist()}


def test_the_file_is_torch_saves_but_for_its_random_serialization_id(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "a" / "state.pt", tmp_path / "b" / "state.pt"  # the name is the archive's
    ours.parent.mkdir()
    theirs.parent.mkdir()
    zipwriter.save(_state(), str(ours))
    torch.save(_state(), str(theirs))
    mine, reference = _records(ours), _records(theirs)
    assert mine.keys() == reference.keys()
    assert mine["data/0"][1] != 0  # a real checksum, not the writer's placeholder
    for name in mine.keys() - {SERIALIZATION_ID}:
        assert mine[name] == reference[name], name
    a, b = ours.read_bytes(), theirs.read_bytes()
    assert len(a) == len(b)
    differing = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    # only the id's bytes and the two places its CRC32 is written (data descriptor, directory)
    assert len(differing) <= len(mine[SERIALIZATION_ID][3]) + 2 * 4


def test_it_loads_and_passes_the_loaders_crc_check(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    state = _state()
    zipwriter.save(state, str(path))
    files.verify(path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["weight"], state["weight"]) and torch.equal(loaded["transposed"], state["transposed"])
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["weight"].untyped_storage().data_ptr()
    assert loaded["ints"][1:3] == ["text", 3.5] and torch.equal(loaded["ints"][3]["nested"], torch.ones(4, dtype=torch.int64))


def test_a_flipped_byte_in_a_tensor_fails_the_check(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    zipwriter.save(_state(), str(path))
    with zipfile.ZipFile(path) as archive:
        record = next(r for r in archive.infolist() if r.filename.endswith("data/0"))
    raw = bytearray(path.read_bytes())
    raw[record.header_offset + 200] ^= 0xFF  # past the header: inside the tensor's bytes
    path.write_bytes(raw)
    with pytest.raises(files.CheckpointError, match="fails its CRC check"):
        files.verify(path)


def test_torchs_own_crc_switch_is_left_alone(tmp_path: Path) -> None:
    before = torch.serialization.get_crc32_options()
    zipwriter.save(_state(), str(tmp_path / "state.pt"))
    assert torch.serialization.get_crc32_options() == before


def test_a_path_torchs_writer_cannot_take_goes_through_torch_save(tmp_path: Path) -> None:
    path = tmp_path / "état.pt"
    zipwriter.save(_state(), str(path))
    files.verify(path)
    assert torch.equal(torch.load(path, weights_only=True)["weight"], _state()["weight"])


def _large_staged() -> dict:
    """A state whose large tensors sit in page-aligned buffers, as the stager leaves them: one a
    whole number of pages, one with a tail past its last page, and a small one beside them."""
    torch.manual_seed(1)
    state = {"pages": torch.randn(1 << 19), "tail": torch.randn((1 << 18) + 25), "small": torch.randn(10)}
    return staging.Stager().stage(state)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "no_o_direct"])
def test_large_tensors_written_around_the_cache_make_torch_saves_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    state = _large_staged()
    opened = []

    def open_direct(path: str) -> int | None:
        opened.append(path)
        return real_open(path) if direct else None  # no O_DIRECT: the tmpfs case

    real_open = zipwriter._open_direct
    monkeypatch.setattr(zipwriter, "_open_direct", open_direct)
    ours, theirs = tmp_path / "a" / "state.pt", tmp_path / "b" / "state.pt"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    zipwriter.save(state, str(ours))
    assert opened  # the large tensors' space was reserved and filled afterwards
    with torch.utils.serialization.config.patch({"save.storage_alignment": zipwriter.PAGE}):
        torch.save(state, str(theirs))
    mine, reference = _records(ours), _records(theirs)
    assert mine.keys() == reference.keys()
    for name in mine.keys() - {SERIALIZATION_ID}:
        assert mine[name] == reference[name], name
    assert mine[".storage_alignment"][3] == b"4096"
    loaded = torch.load(ours, weights_only=True, mmap=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    files.verify(ours)


def test_a_large_tensor_not_on_a_page_goes_through_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    unaligned = torch.randn((1 << 18) + 1)[1:]  # its storage starts wherever the allocator put it
    zipwriter.save({"x": unaligned}, str(path))
    files.verify(path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], unaligned)
