"""The global batch of the full world as the unit of data (DESIGN.md section 14): whatever the
number of ranks that train on it, the same samples in the same global batches, and the same
update as the full world's within 1e-5."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lockstep import Callback, Trainer, dist
from lockstep.elastic import FULL_WORLD_ENV, GlobalBatchSampler, full_world_size, share_loader
from lockstep.testing import run_distributed
from tests.elastic.indexed import PER_RANK_BATCH, SAMPLES, Indexed
from tests.trainer.common import MLP, assert_same_params, error_of, full_params

FULL_WORLD = 4


@pytest.mark.parametrize("size,full_world,batch", [(37, 4, 3), (40, 4, 8), (64, 3, 1), (5, 4, 3), (44, 1, 3)])
def test_the_shares_of_every_world_make_the_full_worlds_global_batches(size: int, full_world: int, batch: int) -> None:
    data = list(range(size))
    for shuffle, drop_last, drop_last_batch in itertools.product((False, True), repeat=3):
        loaders = [DataLoader(data, batch_size=batch, drop_last=drop_last_batch, sampler=DistributedSampler(
            data, num_replicas=full_world, rank=r, shuffle=shuffle, seed=7, drop_last=drop_last))
            for r in range(full_world)]
        for one in loaders:
            one.sampler.set_epoch(3)
        per_rank = [[b.tolist() for b in one] for one in loaders]
        expected = [sorted(itertools.chain(*(per_rank[r][s] for r in range(full_world))))
                    for s in range(len(loaders[0]))]
        for world in range(1, full_world + 1):
            steps: list[list[int]] = [[] for _ in expected]
            shares = []
            for rank in range(world):
                sampler = GlobalBatchSampler(data, full_world=full_world, per_rank_batch=batch, world=world, rank=rank,
                                             shuffle=shuffle, seed=7, drop_last=drop_last,
                                             drop_last_batch=drop_last_batch)
                sampler.set_epoch(3)
                assert len(sampler) == len(loaders[0])
                for s, share in enumerate(sampler):
                    steps[s] += share
                    shares.append(len(share))
            assert [sorted(step) for step in steps] == expected, (world, shuffle, drop_last, drop_last_batch)


def test_shares_differ_by_at_most_one_sample_and_follow_a_new_world_in_place() -> None:
    data = list(range(SAMPLES))
    loader = DataLoader(data, batch_size=PER_RANK_BATCH, sampler=DistributedSampler(data, num_replicas=4, rank=0))
    shared = share_loader(loader, "train_dataloader", FULL_WORLD, 3, 1)
    assert shared is not loader and [len(b) for b in shared] == [4, 4, 4, 3]
    assert share_loader(shared, "train_dataloader", FULL_WORLD, 2, 1) is shared  # re-split in place
    assert [len(b) for b in shared] == [6, 6, 6, 4]
    assert share_loader(loader, "train_dataloader", FULL_WORLD, 4, 0) is loader  # the full world: untouched


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(8)


def test_loaders_that_cannot_be_shared_and_bad_settings_are_one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    data = list(range(SAMPLES))
    for loader in (DataLoader(data, batch_size=3), DataLoader(_Stream(), batch_size=3)):
        for world in (2, 4):  # with the full world there too: before the first step, not at a change
            said = error_of(share_loader, loader, "train_dataloader", 4, world, 0)
            assert "cannot be split into shares of the global batch of 4 ranks" in said and "get_sampler" in said
            assert "\n" not in said
    loader = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert "more than the full world of 2" in error_of(share_loader, loader, "train_dataloader", 2, 3, 0)
    monkeypatch.setenv(FULL_WORLD_ENV, "four")
    assert error_of(full_world_size) == f"{FULL_WORLD_ENV}='four' is not a number of ranks: set it to an " \
                                        f"integer >= 1, or unset it"
    monkeypatch.setenv(FULL_WORLD_ENV, "4")
    assert full_world_size() == 4


class _Log(Callback):
    """The samples of each step this rank trains, and the largest microbatch it ran."""

    def __init__(self) -> None:
        self.steps: dict[int, list[int]] = {}
        self.largest = 0

    def after_dataloader(self, state, logger) -> None:
        self.steps[int(state.timestamp.batch)] = state.batch[2].tolist()

    def before_forward(self, state, logger) -> None:
        self.largest = max(self.largest, len(state.batch[2]))


SHARDED = {"fsdp_config": {"sharding_strategy": "FULL_SHARD", "state_dict_type": "sharded"}}


def _train(folder: str, load: str | None, sharded: bool = False,
           stateful: bool = False) -> tuple[dict[str, torch.Tensor], dict[int, list[int]], int]:
    model, data, log = MLP(), Indexed(), _Log()
    loader = StatefulDataLoader if stateful else DataLoader
    trainer = Trainer(model=model, optimizers=torch.optim.AdamW(model.parameters(), lr=0.01), max_duration="2ep",
                      train_dataloader=loader(data, batch_size=PER_RANK_BATCH,
                                              sampler=dist.get_sampler(data, shuffle=True)),
                      seed=7, progress_bar=False, callbacks=[log], save_folder=folder, save_interval="3ba",
                      save_filename="ep{epoch}-ba{batch}" + ("" if sharded else "-rank{rank}.pt"), load_path=load,
                      **(SHARDED if sharded else {}))
    trainer.fit()
    assert isinstance(trainer.train_dataloader, loader)
    return full_params(model), log.steps, log.largest


def _global_batches(results: list[tuple]) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for _, per_rank, _ in results:
        for step, samples in per_rank.items():
            steps.setdefault(step, []).extend(samples)
    return {step: sorted(samples) for step, samples in sorted(steps.items())}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_fewer_ranks_train_the_full_worlds_global_batches_from_the_start_or_a_mid_epoch_checkpoint(
        tmp_path: Path, stateful: bool) -> None:
    """A StatefulDataLoader stays one when it is split into shares of the global batch, and the
    state a rank of 4 saved (its count of batches, one per global batch) puts a rank of 3 at the
    same global batch."""
    env = {"OMP_NUM_THREADS": "1"}
    full = run_distributed(_train, world_size=FULL_WORLD, args=(str(tmp_path / "full"), None, False, stateful),
                           env=env, timeout=200)
    reference, reference_batches = full[0][0], _global_batches(full)
    assert len(reference_batches) == 8  # 4 global batches an epoch, 2 epochs
    for epoch in (range(4), range(4, 8)):  # every sample once an epoch
        assert sorted(itertools.chain(*(reference_batches[s] for s in epoch))) == list(range(SAMPLES))
    elastic = {**env, FULL_WORLD_ENV: str(FULL_WORLD)}
    fresh = run_distributed(_train, world_size=2, args=(str(tmp_path / "two"), None, False, stateful), env=elastic,
                            timeout=200)
    load = str(tmp_path / "full" / "ep0-ba3-rank{rank}.pt")
    if stateful:  # what each rank of 4 saved
        assert all(entry["loader_state"] for entry in torch.load(load.format(rank=0), weights_only=False)["ranks"])
    resumed = run_distributed(_train, world_size=3, args=(str(tmp_path / "three"), load, False, stateful), env=elastic,
                              timeout=200)
    for results, world, first in ((fresh, 2, 0), (resumed, 3, 3)):
        assert {step: samples for step, samples in reference_batches.items() if step >= first} \
            == _global_batches(results), world
        for rank, (params, _, largest) in enumerate(results):
            assert_same_params(params, reference, atol=1e-5)
            assert largest == PER_RANK_BATCH, (world, rank)  # shares of 4 or 6: microbatches of 3 at most


@pytest.mark.timeout(240)
def test_under_fsdp_two_ranks_resume_four_ranks_sharded_checkpoint_on_its_global_batches(tmp_path: Path) -> None:
    env = {"OMP_NUM_THREADS": "1"}
    full = run_distributed(_train, world_size=FULL_WORLD, args=(str(tmp_path / "full"), None, True), env=env,
                           timeout=200)
    resumed = run_distributed(_train, world_size=2, args=(str(tmp_path / "two"), str(tmp_path / "full" / "ep0-ba3"),
                                                          True), env={**env, FULL_WORLD_ENV: str(FULL_WORLD)}, timeout=200)
    assert {s: b for s, b in _global_batches(full).items() if s >= 3} == _global_batches(resumed)
    for params, _, largest in resumed:
        assert_same_params(params, full[0][0], atol=1e-5)
        assert largest == PER_RANK_BATCH
