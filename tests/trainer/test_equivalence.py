"""Space-time equivalence and sync strategies: compare parameters, not losses."""

from __future__ import annotations

import pytest
import torch

from lockstep import Trainer
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, assert_same_params, loader, params, sgd

GLOBAL_BATCH = 8  # 28 samples: three full global batches and an uneven last one of 4


def train(world_size: int, microbatch_size: int | None, strategy: str | None = None,
          epochs: int = 2, unused_branch: bool = False, precision: str = "fp32") -> dict[str, torch.Tensor]:
    model = MLP(unused_branch)
    trainer = Trainer(model=model, train_dataloader=loader(GLOBAL_BATCH // world_size),
                      max_duration=f"{epochs}ep", optimizers=sgd(model), progress_bar=False,
                      device_train_microbatch_size=microbatch_size, ddp_sync_strategy=strategy,
                      find_unused_parameters=unused_branch, precision=precision)
    trainer.fit()
    assert trainer.state.timestamp.batch == 4 * epochs and trainer.state.timestamp.sample == 28 * epochs
    return params(model)


def _train_rank(microbatch_size, strategy=None, unused_branch=False):
    from lockstep import dist
    return train(dist.get_world_size(), microbatch_size, strategy, unused_branch=unused_branch)


def _train_all_strategies(microbatch_size):
    return [_train_rank(microbatch_size, s) for s in ("single_auto_sync", "multi_auto_sync", "forced_sync")]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """One process, no launcher, no microbatches: the plain global-batch math."""
    return train(1, None)


def test_one_process_microbatches_even_and_uneven(reference) -> None:
    assert_same_params(train(1, 2), reference)  # 1 x 4 microbatches
    assert_same_params(train(1, 3), reference)  # 3 + 3 + 2: uneven microbatches


@pytest.mark.timeout(180)
def test_two_ranks_every_strategy_with_and_without_microbatches(reference) -> None:
    for rank_result in run_distributed(_train_all_strategies, world_size=2, args=(2,), timeout=150):
        for strategy_params in rank_result:  # 2 x 2 microbatches
            assert_same_params(strategy_params, reference)
    for rank_params in run_distributed(_train_rank, world_size=2, args=(None,), timeout=150):
        assert_same_params(rank_params, reference)  # 2 x 1


@pytest.mark.timeout(180)
def test_four_ranks_one_microbatch(reference) -> None:
    for rank_params in run_distributed(_train_rank, world_size=4, args=(None,), timeout=150):
        assert_same_params(rank_params, reference)


def _train_unused(strategy):
    return _train_rank(2, strategy, unused_branch=True)


@pytest.mark.timeout(180)
def test_unused_parameters_multi_auto_and_forced_sync_agree() -> None:
    reference = train(1, None, unused_branch=True)
    for strategy in ("multi_auto_sync", "forced_sync"):
        for rank_params in run_distributed(_train_unused, world_size=2, args=(strategy,), timeout=150):
            assert_same_params(rank_params, reference)


def _unequal_ranks():
    """Rank 0 holds batches of 5 samples, rank 1 of 3; rank 0 has one batch more than rank 1."""
    from lockstep import dist
    from tests.trainer.common import dataset
    ds = dataset(40)
    x, y = ds.tensors
    rank = dist.get_global_rank()
    batches = [(x[i * 8 + (0 if rank == 0 else 5):i * 8 + (5 if rank == 0 else 8)],
                y[i * 8 + (0 if rank == 0 else 5):i * 8 + (5 if rank == 0 else 8)])
               for i in range(4 if rank == 0 else 3)]
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=batches, max_duration="2ep", optimizers=sgd(model),
                      progress_bar=False, device_train_microbatch_size=2)
    trainer.fit()
    return params(model), trainer.state.timestamp.batch, trainer.state.timestamp.sample


@pytest.mark.timeout(180)
def test_unequal_rank_batches_and_lengths_stop_together_with_exact_math() -> None:
    model = MLP()
    from tests.trainer.common import dataset
    x, y = dataset(40).tensors
    batches = [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]) for i in range(3)]
    Trainer(model=model, train_dataloader=batches, max_duration="2ep", optimizers=sgd(model),
            progress_bar=False).fit()
    for rank_params, steps, samples in run_distributed(_unequal_ranks, world_size=2, timeout=150):
        assert (steps, samples) == (6, 48)  # 3 steps per epoch: the shorter rank ends the epoch
        assert_same_params(rank_params, params(model))


def _count_allreduce_passes(strategy):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from lockstep import Callback
    model = MLP()
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    class PerStep(Callback):
        def batch_end(self, state, logger):
            per_step.append(len(calls))
            calls.clear()

    per_step: list[int] = []
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="3ba", optimizers=sgd(model),
                      progress_bar=False, device_train_microbatch_size=1, ddp_sync_strategy=strategy,
                      callbacks=[PerStep()])
    trainer.strategy.module.register_comm_hook(None, counting_hook)
    trainer.fit()
    return per_step


@pytest.mark.timeout(180)
def test_single_auto_sync_reduces_once_per_step_multi_per_microbatch() -> None:
    # The tiny model fits in one DDP bucket: one hook call is one all-reduce pass.
    single = run_distributed(_count_allreduce_passes, world_size=2, args=("single_auto_sync",), timeout=150)
    assert single == [[1, 1, 1]] * 2
    multi = run_distributed(_count_allreduce_passes, world_size=2, args=("multi_auto_sync",), timeout=150)
    assert multi == [[4, 4, 4]] * 2  # batch 4, microbatch 1: four passes


def _gradients_in_the_bucket():
    """The Trainer's gradients after each synced backward, and a hand-written DDP loop's weights."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from lockstep import Callback

    storages: list[int] = []

    class AfterBackward(Callback):
        def after_backward(self, state, logger):
            storages.append(len({p.grad.untyped_storage().data_ptr() for p in state.model.parameters()}))

    model = MLP()
    Trainer(model=model, train_dataloader=loader(4), max_duration="3ba", optimizers=sgd(model),
            progress_bar=False, callbacks=[AfterBackward()]).fit()
    plain = MLP()
    ddp, optimizer = DistributedDataParallel(plain), sgd(plain)  # DDP's defaults: gradients copied out
    for x, y in list(loader(4))[:3]:
        F.cross_entropy(ddp((x, y)), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return storages, params(model), params(plain)


@pytest.mark.timeout(180)
def test_gradients_stay_in_the_ddp_bucket_with_the_default_loops_exact_weights() -> None:
    for storages, trainer_params, plain_params in run_distributed(_gradients_in_the_bucket, world_size=2, timeout=150):
        assert storages == [1, 1, 1]  # the tiny model is one bucket: every gradient a view of it
        for name, value in trainer_params.items():
            assert torch.equal(value, plain_params[name]), name
