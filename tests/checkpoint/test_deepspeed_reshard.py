"""ZeRO-3's layout, cut anew for another world size (``lockstep.checkpoint.deepspeed_reshard``):
each parameter whole again from the saved ranks' flat partitions, and each new rank's slice of it.
The reshard of a real engine's checkpoint, over real ranks, is in ``tests/elastic/test_shrink.py``."""

from __future__ import annotations

import pytest
import torch

from lockstep.checkpoint.deepspeed_reshard import _Stage3Layout
from lockstep.checkpoint.files import CheckpointError

SHAPES = {"embed.weight": (5, 3), "norm.weight": (3,), "head.bias": (7,)}


def _partitions(params: dict[str, torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """Each rank's flat partition as ZeRO-3 lays it out: every parameter's ``ceil(numel / W)``
    elements, the last rank's padded (here with NaN: the padding is never read)."""
    flats = [[] for _ in range(world_size)]
    for value in params.values():
        size = -(-value.numel() // world_size)
        padded = torch.full((size * world_size,), float("nan"))
        padded[:value.numel()] = value.reshape(-1)
        for rank in range(world_size):
            flats[rank].append(padded[rank * size:(rank + 1) * size])
    return [torch.cat(parts) for parts in flats]


@pytest.mark.parametrize("saved,now", [(3, 2), (2, 4), (4, 3)])
def test_each_parameter_is_whole_again_and_each_rank_takes_its_slice_of_the_new_partitioning(saved, now) -> None:
    params = {name: torch.randn(shape) for name, shape in SHAPES.items()}
    layout = _Stage3Layout({"param_shapes": [{k: torch.Size(v) for k, v in SHAPES.items()}]}, saved)
    whole = layout.whole(_partitions(params, saved))
    assert all(torch.equal(whole[name], value.reshape(-1)) for name, value in params.items())
    expected = _partitions(params, now)
    # the new engine's sub-groups: the parameters in two groups, with their new partition sizes
    groups = [[(name, -(-params[name].numel() // now)) for name in names]
              for names in (["embed.weight"], ["norm.weight", "head.bias"])]
    for rank in range(now):
        cut = torch.cat([layout.cut(whole, group, rank, torch.zeros(0)) for group in groups])
        assert torch.equal(torch.nan_to_num(expected[rank], nan=0.0), cut), rank  # zero-padded


def test_a_parameter_the_checkpoint_lacks_keeps_the_engines_own_slice() -> None:
    layout = _Stage3Layout({"param_shapes": [{"a": torch.Size([4])}]}, 2)
    whole = layout.whole([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    live = torch.tensor([9.0, 9.0, 8.0, 8.0])  # this rank's partition now: a (2 elements), then b
    assert torch.equal(layout.cut(whole, [("a", 2), ("b", 2)], 1, live), torch.tensor([3.0, 4.0, 8.0, 8.0]))


def test_frozen_parameters_are_refused_in_one_line() -> None:
    with pytest.raises(CheckpointError, match="frozen parameters") as error:
        _Stage3Layout({"param_shapes": [{}], "frozen_param_shapes": {"a": torch.Size([2])}}, 2)
    assert "\n" not in str(error.value)


def test_partitions_that_do_not_hold_the_parameters_slices_are_refused_in_one_line(tmp_path) -> None:
    layout = _Stage3Layout({"param_shapes": [{"a": torch.Size([4]), "b": torch.Size([3])}]}, 2)
    layout.check([[2, 2], [4]], tmp_path)  # 2 + 2 elements a rank, in sub-groups of any split
    with pytest.raises(CheckpointError, match="does not reshard") as error:
        layout.check([[4], [5]], tmp_path)  # one rank's partition holds more (another group's)
    assert "\n" not in str(error.value)
