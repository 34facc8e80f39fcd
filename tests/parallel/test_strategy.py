"""Each backend object, driven through the Strategy interface the Trainer uses: one step with
global-norm clipping equals one process clipping the whole batch's gradients."""

from __future__ import annotations

import pytest
import torch

from lockstep import dist
from lockstep.parallel.config import ParallelConfig, build_strategy
from lockstep.testing import run_distributed
from tests.trainer.common import BlockMLP, assert_same_params, dataset, full_params

MAX_NORM = 0.02  # far below the gradients' norm (about 0.16): clipping scales every gradient


def _step(parallel: ParallelConfig, microbatches: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One SGD step on rank r's half of the batch, split into microbatches, with clipping."""
    torch.manual_seed(0)
    model = BlockMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    strategy = build_strategy(parallel, device=torch.device("cpu"), precision="fp32", train_dataloader=None,
                              microbatch_size=None, grad_accum=None, num_optimizers=1)
    dist.initialize_dist("cpu", single_process_group=strategy.needs_process_group)
    strategy.setup(model, [optimizer])
    x, y = dataset(16).tensors
    world, rank = dist.get_world_size(), dist.get_global_rank()
    mine = torch.arange(rank, 16, world)
    chunks = list(zip(x[mine].chunk(microbatches), y[mine].chunk(microbatches)))
    for i, micro in enumerate(chunks):
        with strategy.sync_context(i == len(chunks) - 1):
            loss = model.loss(strategy.module(micro), micro)
            strategy.backward(loss * (len(micro[0]) * world / 16))
    norm = strategy.clip_gradients_norm(MAX_NORM)
    strategy.optimizer_step()
    return float(norm), full_params(model)


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = BlockMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    batch = dataset(16).tensors
    model.loss(model(batch), batch).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return float(norm), full_params(model)


def _every_backend() -> list[tuple[float, dict[str, torch.Tensor]]]:
    configs = [ParallelConfig(), ParallelConfig(ddp_sync_strategy="forced_sync"),
               ParallelConfig(fsdp_config={"sharding_strategy": "FULL_SHARD"}),
               ParallelConfig(fsdp_config={"sharding_strategy": "SHARD_GRAD_OP"}),
               ParallelConfig(fsdp_config={"cpu_offload": True})]
    return [_step(config, microbatches=2) for config in configs]


@pytest.mark.timeout(180)
def test_global_norm_clipping_equals_one_process(reference) -> None:
    norm, expected = reference
    assert norm > 5 * MAX_NORM  # the threshold really clips
    for rank_results in run_distributed(_every_backend, world_size=2, timeout=160):
        for got_norm, params in rank_results:
            assert got_norm == pytest.approx(norm, rel=1e-5)
            assert_same_params(params, expected, atol=1e-6)


def _hybrid() -> tuple[float, dict[str, torch.Tensor]]:
    return _step(ParallelConfig(fsdp_config={"sharding_strategy": "HYBRID_SHARD"}), microbatches=1)


@pytest.mark.timeout(180)
def test_global_norm_clipping_under_hybrid_shard(reference) -> None:
    norm, expected = reference
    for got_norm, params in run_distributed(_hybrid, world_size=4, local_world_size=2, timeout=160):
        assert got_norm == pytest.approx(norm, rel=1e-5)
        assert_same_params(params, expected, atol=1e-6)


def test_deepspeed_clipping_is_its_own_config() -> None:
    pytest.importorskip("deepspeed")
    strategy = build_strategy(ParallelConfig(deepspeed_config={}), device=torch.device("cpu"), precision="fp32",
                              train_dataloader=None, microbatch_size=None, grad_accum=None, num_optimizers=1)
    with pytest.raises(ValueError, match="gradient_clipping"):
        strategy.clip_gradients_norm(1.0)
