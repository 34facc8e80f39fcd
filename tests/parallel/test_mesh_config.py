"""Meshes that cannot work are refused at ``Trainer(...)``, before any process group or rank trains,
with a message that names what to change (issue 52, item 5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lockstep import Trainer
from lockstep.parallel.mesh import MeshShape, resolve_shape
from lockstep.parallel.tensor_parallel import check_plan, parse
from lockstep.utils.parallelism import FSDPConfig, ParallelismConfig, TPConfig
from tests.trainer.common import MLP, loader, sgd


@pytest.mark.parametrize("degrees, shape", [
    (dict(), MeshShape(None, 8, 1)),
    (dict(replicate=2), MeshShape(2, 4, 1)),
    (dict(replicate=-1, shard=2), MeshShape(4, 2, 1)),
    (dict(tensor=2), MeshShape(None, 4, 2)),
    (dict(replicate=2, shard=2, tensor=2), MeshShape(2, 2, 2)),
])
def test_the_degrees_fill_the_world_as_composer_s_do(degrees: dict, shape: MeshShape) -> None:
    assert resolve_shape(8, **degrees) == shape


@pytest.mark.parametrize("degrees, message", [
    (dict(shard=3), "data_parallel_shard_degree=3, tensor_parallel_degree=1 needs 3 ranks, but the world size is 8"),
    (dict(replicate=3), "needs a multiple of 3 ranks, but the world size is 8"),
    (dict(replicate=-1), "are both -1: at most one degree"),
    (dict(shard=0), "data_parallel_shard_degree=0 must be a positive integer or -1"),
    (dict(tensor=-1), "tensor_parallel_degree=-1: give the number of ranks"),
])
def test_degrees_that_do_not_divide_the_world_are_refused(degrees: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_shape(8, **degrees)


def test_a_layer_plan_naming_no_module_is_refused_with_the_modules_there_are() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    check_plan(model, {"0": ColwiseParallel(), "*": RowwiseParallel()})  # a pattern matches
    with pytest.raises(ValueError, match=r"layer_plan names 'fc1', which is no module of Sequential: its modules "
                                         r"include 0, 1, 2"):
        check_plan(model, {"fc1": ColwiseParallel()})


def test_a_tp_config_is_checked_and_degree_1_means_none() -> None:
    assert parse({"tensor_parallel_degree": 1, "layer_plan": {"fc1": ColwiseParallel()}}) is None
    tp = parse(TPConfig(layer_plan={"fc1": ColwiseParallel()}, tensor_parallel_degree=2))
    assert tp is not None and tp.degree == 2 and list(tp.plan) == ["fc1"]
    with pytest.raises(ValueError, match="needs a layer_plan"):
        parse({"tensor_parallel_degree": 2})
    with pytest.raises(ValueError, match=r"layer_plan\['fc1'\]='colwise': the plan maps module names"):
        parse({"tensor_parallel_degree": 2, "layer_plan": {"fc1": "colwise"}})
    with pytest.raises(ValueError, match="unknown key"):
        parse({"degree": 2})


def _trainer(**kwargs) -> Trainer:
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(8), optimizers=sgd(model), max_duration="1ba",
                   progress_bar=False, **kwargs)


TP = {"tensor_parallel_degree": 2, "layer_plan": {"fc1": ColwiseParallel()}}


@pytest.mark.parametrize("kwargs, message", [
    (dict(parallelism_config={"tp": TP}), r"tensor parallelism shards the rest of the model with FSDP: add "
                                          r"parallelism_config\['fsdp'\]"),
    (dict(parallelism_config={"tp": TP}, deepspeed_config={}), "does not work with deepspeed_config"),
    (dict(parallelism_config={"fsdp": {}, "tp": TP}), r"tensor_parallel_degree=2 needs a multiple of 2 ranks, but the world size is 1"),
    (dict(fsdp_config={"data_parallel_replicate_degree": 2}), "needs a multiple of 2 ranks, but the world size is 1"),
    (dict(parallelism_config=ParallelismConfig(fsdp=FSDPConfig(data_parallel_shard_degree=2))),
     "needs 2 ranks, but the world size is 1"),
    (dict(fsdp_config={"sharding_strategy": "NO_SHARD", "data_parallel_shard_degree": 1}), "NO_SHARD: drop one"),
    (dict(parallelism_config={"fsdp": {}, "pp": {}}), "parallelism_config has unknown key"),
])
def test_a_mesh_that_cannot_work_fails_at_trainer_before_any_process_group(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _trainer(**kwargs)
    assert not torch.distributed.is_initialized()
