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


def _shards_made_whole(_: int) -> dict:
    """Two ranks shard a model whose tensors have fewer rows than ranks, an odd number and a tie,
    take a step of AdamW, and make the whole state from the shards each holds."""
    import torch.distributed as torch_dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    from lockstep import dist
    from lockstep.parallel import fsdp_peers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))  # rows 5, 5, 1 (rank 1 holds none), 1
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3) + dist.get_global_rank()).sum().backward()
    optimizer.step()
    own = fsdp_peers.own_shards(model, [optimizer])
    held = [None, *dist.all_gather_object(own)]  # and a rank that joined, holding none
    full = StateDictOptions(full_state_dict=True)
    out = {"whole": fsdp_peers.whole_state(held, own), "joined": fsdp_peers.whole_state(held, None),
           "model": get_model_state_dict(model, options=full),
           "optimizers": [get_optimizer_state_dict(model, optimizer, options=full)]}
    torch_dist.barrier()
    return out


def test_fsdp_state_is_made_whole_from_the_shards_each_rank_holds() -> None:
    from lockstep.testing import run_distributed

    for rank in run_distributed(_shards_made_whole, world_size=2, args=(0,), timeout=120):
        for view in ("whole", "joined"):
            made = rank[view]
            assert made["model"].keys() == rank["model"].keys()
            for key, value in rank["model"].items():
                assert torch.equal(made["model"][key], value), (view, key)
            state, expected = made["optimizers"][0]["state"], rank["optimizers"][0]["state"]
            assert state.keys() == expected.keys() and len(state) == 4
            for name, moments in expected.items():
                for key, value in moments.items():
                    assert torch.equal(state[name][key], value), (view, name, key)
            assert made["optimizers"][0]["param_groups"] == rank["optimizers"][0]["param_groups"]
