"""The in-memory copy a background checkpoint write works from."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from lockstep.checkpoint import staging


def test_staged_copy_is_independent_and_keeps_shared_storage() -> None:
    base = torch.arange(12.0)
    state = OrderedDict(a=base[:6], b=base[6:].view(2, 3), step=torch.tensor(3.0))
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    content = {"model": state, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    stager = staging.Stager()
    staged = stager.stage(content)
    base += 100  # training goes on in place
    content["groups"][0]["lr"] = 0.5
    assert torch.equal(staged["model"]["a"], torch.arange(6.0))
    assert torch.equal(staged["model"]["b"], torch.arange(6.0, 12.0).view(2, 3))
    assert staged["model"]["a"].untyped_storage().data_ptr() == staged["model"]["b"].untyped_storage().data_ptr()
    assert staged["model"]._metadata == {"": {"version": 1}} and isinstance(staged["model"], OrderedDict)
    assert staged["groups"][0] == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert staging.storage_bytes(content) == 12 * 4 + 4


def test_stager_reuses_its_buffers_for_the_next_save() -> None:
    stager = staging.Stager()
    w = torch.zeros(1000)
    first = stager.stage({"w": w})["w"]
    w += 1
    second = stager.stage({"w": w})["w"]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert torch.equal(second, torch.ones(1000))
    bigger = stager.stage({"w": torch.full((2000,), 2.0)})["w"]  # another size: a new buffer
    assert torch.equal(bigger, torch.full((2000,), 2.0))


def test_storages_left_for_later_are_copied_by_copy_later() -> None:
    weights, buffer = torch.zeros(8), torch.zeros(4)
    stager = staging.Stager()
    staged = stager.stage({"w": weights[2:], "b": buffer}, later={staging.storage_key(weights.untyped_storage())})
    buffer += 1  # copied by stage: the change is not in the copy
    weights += 2  # left for later: what it holds when copy_later runs is
    assert torch.equal(staged["b"], torch.zeros(4))
    stager.copy_later()
    weights += 3  # after the copy: not in it
    assert torch.equal(staged["w"], torch.full((6,), 2.0))
    stager.copy_later()  # nothing left to copy
    assert torch.equal(staged["w"], torch.full((6,), 2.0))


def test_a_copy_that_does_not_fit_in_memory_is_refused_and_kept_buffers_cost_nothing(monkeypatch) -> None:
    reads = []

    def available() -> int:
        reads.append(1)
        return 10_000

    monkeypatch.setattr(staging, "_available_memory", available)
    stager = staging.Stager()
    stager.stage({"w": torch.zeros(1000)})  # 4000 bytes: within half of 10 000
    assert len(reads) == 1
    stager.stage({"w": torch.ones(1000)})  # the same buffer again: free memory is not read
    assert len(reads) == 1
    with pytest.raises(staging.DoesNotFit):
        stager.stage({"w": torch.zeros(1000), "v": torch.zeros(1500)})  # 6000 more: past half
    assert stager._buffers == []  # what it held is let go: the caller writes directly instead
