"""The pieces an elastic FSDP or ZeRO-3 job rebuilds its model from (``lockstep.parallel.skeleton``)
and FSDP's waited collectives; the rebuild itself, over real ranks, is in ``tests/elastic/test_shrink.py``."""

from __future__ import annotations

import torch
from torch import nn

from lockstep.parallel import fsdp_elastic, skeleton


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("table", torch.arange(4.0), persistent=False)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)


def test_a_skeleton_holds_the_modules_on_the_meta_device_with_ties_kept_and_the_model_untouched() -> None:
    model = _Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bones = skeleton.skeleton(model)
    assert all(t.is_meta for t in [*bones.parameters(), *bones.buffers()])
    assert bones.head.weight is bones.embed.weight and bones.head.weight is not model.head.weight
    assert not bones.frozen.requires_grad and bones.table.shape == (4,)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is not moved


def test_a_model_made_from_the_skeleton_takes_the_old_buffers_and_the_optimizer_follows_by_name() -> None:
    model = _Tied()
    model.norm.running_mean.fill_(3.0)
    model.table.fill_(7.0)  # a non-persistent buffer, which no checkpoint holds
    optimizer = torch.optim.AdamW([{"params": [model.embed.weight]}, {"params": [model.norm.weight], "lr": 0.5}])
    names = skeleton.parameter_names(model, [optimizer])
    model.head(model.embed(torch.tensor([1]))).sum().backward()
    optimizer.step()
    assert optimizer.state  # state for the old parameters
    new = skeleton.materialize(skeleton.skeleton(model), torch.device("cpu"), model)
    assert torch.equal(new.norm.running_mean, torch.full((4,), 3.0)) and torch.equal(new.table, torch.full((4,), 7.0))
    assert new.head.weight is new.embed.weight
    skeleton.point_optimizers(new, [optimizer], names)
    assert optimizer.param_groups[0]["params"] == [new.embed.weight]
    assert optimizer.param_groups[1]["params"] == [new.norm.weight] and optimizer.param_groups[1]["lr"] == 0.5
    assert not optimizer.state


_DCP_METHODS = ("broadcast_object", "all_gather_object", "gather_object", "scatter_object", "barrier")


def test_dcps_collectives_that_an_elastic_job_replaces_are_the_installed_torchs(monkeypatch) -> None:
    """lockstep replaces five methods of DCP's private ``_DistWrapper`` in an elastic job (their
    waits would outlast a lost rank): a torch that renames or reshapes one fails here, not as a
    sharded checkpoint's write that hangs."""
    import inspect

    from torch.distributed.checkpoint.utils import _DistWrapper

    for name in _DCP_METHODS:
        theirs = list(inspect.signature(getattr(_DistWrapper, name)).parameters)
        ours = list(inspect.signature(getattr(fsdp_elastic, f"_{name}")).parameters)
        assert len(theirs) == len(ours), (name, theirs, ours)
    for name in _DCP_METHODS:
        monkeypatch.setattr(_DistWrapper, name, getattr(_DistWrapper, name))  # put back after the test
    fsdp_elastic.wait_dcp_through_lockstep()
    assert all(getattr(_DistWrapper, name) is getattr(fsdp_elastic, f"_{name}") for name in _DCP_METHODS)
    alone = _DistWrapper(None, False, 0)  # without a process group, as DCP runs in one process
    assert alone.broadcast_object({"a": 1}) == {"a": 1} and alone.scatter_object(["x"]) == "x"
    assert alone.gather_object(3) == [3] and alone.all_gather_object(4) == [4] and alone.barrier() is None
    # DCP's own steps, built on the gather, scatter and broadcast above
    assert alone.all_reduce("step", lambda: 1, sum) == 1
    assert alone.reduce_scatter("step", lambda: 5, lambda values: [v * 2 for v in values]) == 10
