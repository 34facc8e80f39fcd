"""Composer's Trainer defaults and argument forms, and the state of callbacks and algorithms in
checkpoints: what a Composer script relies on without saying it."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep import Trainer
from lockstep.algorithms import EMA, GradientClipping
from lockstep.core import Callback, Event, Time, TimeUnit
from lockstep.loggers import InMemoryLogger
from lockstep.optim import DecoupledSGDW
from tests.trainer.common import MLP, loader, params, sgd


def test_no_optimizer_is_composers_decoupled_sgdw_with_a_warning() -> None:
    model = MLP()
    with pytest.warns(UserWarning, match=r"No optimizer was specified. Defaulting to DecoupledSGDW\(lr=0.1\)"):
        trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", progress_bar=False)
    optimizer, = trainer.state.optimizers
    assert isinstance(optimizer, DecoupledSGDW) and optimizer.defaults["lr"] == 0.1
    before = params(model)
    trainer.fit()
    assert any(not torch.equal(before[k], v) for k, v in params(model).items())  # it trained


class Counter(Callback):
    """Counts batches, and keeps the count in checkpoints."""

    def __init__(self) -> None:
        self.batches = 0
        self.events: dict[Event, int] = {}

    def batch_end(self, state, logger) -> None:
        self.batches += 1
        self.events[Event.BATCH_END] = self.events.get(Event.BATCH_END, 0) + 1

    def state_dict(self):
        return {"batches": self.batches, "events": self.events}

    def load_state_dict(self, state) -> None:
        self.batches = state["batches"]
        self.events.update(state["events"])


def test_one_object_or_none_for_callbacks_loggers_and_algorithms(monkeypatch) -> None:
    monkeypatch.setenv("COMPOSER_RUN_NAME", "from-composer-variable")
    monkeypatch.setenv("LOCKSTEP_RUN_NAME", "not-this-one")
    counter, memory, clipping = Counter(), InMemoryLogger(), GradientClipping("norm", 1.0)
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="3ba", optimizers=sgd(model),
                      callbacks=counter, loggers=memory, algorithms=clipping, progress_bar=False)
    assert counter in trainer.state.callbacks and memory in trainer.state.callbacks
    assert trainer.state.algorithms == [clipping] and trainer.state.run_name == "from-composer-variable"
    trainer.fit()
    assert counter.batches == 3 and "loss/train/total" in memory.data
    other = MLP()
    none = Trainer(model=other, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(other),
                   callbacks=None, loggers=None, algorithms=None, progress_bar=False)
    assert none.state.algorithms == []


def test_a_callbacks_and_emas_state_resume_with_the_checkpoint(tmp_path) -> None:
    """Stopped after 4 of 8 batches and resumed: the callback's count and EMA's averages go on as
    in the uninterrupted run, and so do the parameters, bit for bit."""
    def run(max_duration: str, folder: str, load_path: str | None = None):
        model, counter, ema = MLP(), Counter(), EMA(half_life="3ba")
        trainer = Trainer(model=model, train_dataloader=loader(4), max_duration=max_duration,
                          optimizers=sgd(model), callbacks=[counter], algorithms=[ema], progress_bar=False,
                          save_folder=str(tmp_path / folder), save_interval="4ba", load_path=load_path)
        trainer.fit()
        return model, counter, ema

    model, counter, ema = run("8ba", "whole")
    _, first_half, _ = run("4ba", "half")
    assert first_half.batches == 4
    resumed_model, resumed_counter, resumed_ema = run("8ba", "resumed", str(tmp_path / "half" / "ep0-ba4-rank0.pt"))
    assert resumed_counter.batches == counter.batches == 8
    assert resumed_counter.events[Event.BATCH_END] == 8  # an enum key saved as its value updates the same entry
    for name, average in ema.parameters.items():
        assert torch.equal(resumed_ema.parameters[name], average), name
    for (name, a), b in zip(params(model).items(), params(resumed_model).values()):
        assert torch.equal(a, b), name


def test_a_state_a_checkpoint_cannot_hold_is_left_out_with_a_warning(tmp_path) -> None:
    class Opaque(Callback):
        def state_dict(self):
            return {"handle": object()}

    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", optimizers=sgd(model),
                      callbacks=[Opaque()], save_folder=str(tmp_path), save_interval="1ba", progress_bar=False)
    with pytest.warns(UserWarning, match="callback .*Opaque's state_dict.. holds a object"):
        trainer.fit()
    saved = torch.load(tmp_path / "ep0-ba1-rank0.pt", weights_only=True)  # still loads safely
    assert not any(name.endswith("Opaque") for name in saved["state"]["callbacks"])


def test_a_max_duration_in_wall_clock_seconds_stops_training() -> None:
    """'0h0m1s': batches of 0.4 s each, so the run stops after the third (1.2 s >= 1 s)."""
    class Slow(Callback):
        def batch_start(self, state, logger) -> None:
            time.sleep(0.4)

    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="0h0m1s", optimizers=sgd(model),
                      callbacks=[Slow()])
    assert trainer.state.max_duration == Time(1, TimeUnit.SECOND)
    trainer.fit()
    assert trainer.state.timestamp.batch == 3


class LazyRandomDataset(torch.utils.data.Dataset):
    """Draws its samples from the global generator when first read, as Composer's test datasets do."""

    def __init__(self, size: int) -> None:
        self.size, self.x, self.y = size, None, None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):
        if self.x is None:
            self.x, self.y = torch.randn(self.size, 6), torch.randint(0, 3, (self.size,))
        return self.x[i], self.y[i]


def test_a_resumed_run_reads_the_data_a_lazy_random_dataset_drew_as_the_uninterrupted_one(tmp_path) -> None:
    """Composer's spin: before a resumed run's RNG goes back, the evaluation loaders and the epochs
    already done are read once, so a dataset drawn at random when first read is drawn alike."""
    def run(folder: str, load_path: str | None = None, spin: bool = True) -> dict[str, torch.Tensor]:
        model = MLP()
        train, evaluation = LazyRandomDataset(12), LazyRandomDataset(6)
        trainer = Trainer(model=model, train_dataloader=DataLoader(train, batch_size=4),
                          eval_dataloader=DataLoader(evaluation, batch_size=3), max_duration="3ep",
                          optimizers=sgd(model), seed=3, progress_bar=False, save_folder=str(tmp_path / folder),
                          save_interval="1ep", load_path=load_path, spin_dataloaders=spin)
        trainer.fit()
        return params(model)

    whole = run("whole")
    resumed = run("resumed", str(tmp_path / "whole" / "ep1-ba3-rank0.pt"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    unspun = run("unspun", str(tmp_path / "whole" / "ep1-ba3-rank0.pt"), spin=False)
    assert any(not torch.equal(whole[k], unspun[k]) for k in whole)  # what the spin is for


def test_keeping_no_checkpoints_deletes_each_once_written(tmp_path) -> None:
    from tests.trainer.common import error_of

    model = MLP()
    saved = []

    class Seen(Callback):
        def batch_checkpoint(self, state, logger) -> None:
            saved.append(state.timestamp.batch.value)

    trainer = Trainer(model=model, train_dataloader=loader(8), max_duration="4ba", optimizers=sgd(model),
                      save_folder=str(tmp_path / "ck"), save_interval="1ba", save_num_checkpoints_to_keep=0,
                      callbacks=[Seen()], progress_bar=False)
    trainer.fit()
    assert [p.name for p in (tmp_path / "ck").iterdir()] == []  # no checkpoint, no latest pointer
    assert len(trainer.saved_checkpoints) == 4 and saved == [1, 2, 3, 4]
    assert "autoresume" in error_of(Trainer, model=model, save_folder=str(tmp_path / "a"), autoresume=True,
                                    save_num_checkpoints_to_keep=0, optimizers=sgd(model), run_name="r")
    assert "bucket" in error_of(Trainer, model=model, save_folder="s3://b/x", save_num_checkpoints_to_keep=0,
                                optimizers=sgd(model))


def test_two_runs_started_in_the_same_second_have_different_names() -> None:
    models = [MLP() for _ in range(3)]
    names = {Trainer(model=m, optimizers=sgd(m), progress_bar=False).state.run_name for m in models}
    assert len(names) == 3
