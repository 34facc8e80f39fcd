"""Every one of Composer 0.32.1's ``Trainer.fit`` arguments: each one changes the run from that
``fit`` on as the Trainer's argument of that name does."""

from __future__ import annotations

import inspect

import pytest
import torch

from lockstep import Callback, Trainer
from lockstep.optim import LinearScheduler
from tests.trainer.common import MLP, error_of, loader, params

pytestmark = pytest.mark.timeout(120)

# Composer 0.32.1's Trainer.fit keyword arguments, in its order.
COMPOSER_FIT_ARGUMENTS = [
    "train_dataloader", "train_dataloader_label", "train_subset_num_batches", "spin_dataloaders", "duration",
    "reset_time", "schedulers", "scale_schedule_ratio", "step_schedulers_every_batch", "eval_dataloader",
    "eval_subset_num_batches", "eval_interval", "device_train_microbatch_size", "precision",
]


class Seen(Callback):
    """The learning rate and the data's label at each batch, and each evaluation's label and batch."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.labels: list[str] = []
        self.evaluated: list[tuple[str, int]] = []

    def batch_start(self, state, logger=None) -> None:
        self.lrs.append(state.optimizers[0].param_groups[0]["lr"])
        self.labels.append(state.dataloader_label)

    def eval_end(self, state, logger=None) -> None:
        self.evaluated.append((state.dataloader_label, state.timestamp.batch.value))


def trainer(**kwargs) -> tuple[Trainer, Seen]:
    torch.manual_seed(0)
    model, seen = MLP(), Seen()
    kwargs.setdefault("train_dataloader", loader(7))
    built = Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[seen],
                    progress_bar=False, **kwargs)
    return built, seen


def test_fit_takes_every_composer_argument() -> None:
    ours = set(inspect.signature(Trainer.fit).parameters)
    assert [name for name in COMPOSER_FIT_ARGUMENTS if name not in ours] == []


def test_schedulers_given_to_fit_train_as_given_to_the_trainer() -> None:
    built, at_init = trainer(max_duration="6ba", schedulers=LinearScheduler(t_max="1dur"), scale_schedule_ratio=0.5)
    built.fit()
    later, at_fit = trainer()
    later.fit(duration="6ba", schedulers=LinearScheduler(t_max="1dur"), scale_schedule_ratio=0.5)
    assert later.state.timestamp.batch == built.state.timestamp.batch == 3  # 6ba stretched by 0.5
    assert at_fit.lrs == at_init.lrs and at_fit.lrs[0] > at_fit.lrs[-1]
    for name, value in params(built.state.model).items():
        assert torch.equal(params(later.state.model)[name], value), name


def test_evaluators_subsets_and_labels_given_to_fit() -> None:
    built, seen = trainer(max_duration="4ba", eval_dataloader=loader(7), eval_interval="3ba")  # an epoch
    built.fit()
    built.fit(duration="4ba", train_dataloader=loader(7), train_dataloader_label="more", train_subset_num_batches=2,
              eval_dataloader=loader(14), eval_interval="3ba", eval_subset_num_batches=1)
    # 3ba, and the end of the first fit; 6ba, and the end of the second, of the new evaluator
    assert seen.evaluated == [("eval", 3), ("eval", 4), ("eval", 6), ("eval", 8)]
    assert seen.labels == ["train"] * 4 + ["more"] * 4
    assert built.state.timestamp.epoch == 3 and built.state.batches_per_epoch == 2  # then 2 epochs of 2 batches
    assert [(e.dataloader.dataloader.batch_size, e.subset_num_batches) for e in built.evaluators] == [(14, 1)]
    assert list(built.state.eval_metrics) == ["eval"]


def test_microbatches_and_precision_given_to_fit_train_as_given_to_the_trainer() -> None:
    built, _ = trainer(max_duration="3ba", device_train_microbatch_size=3, precision="amp_bf16")
    built.fit()
    later, _ = trainer(max_duration="3ba")
    later.fit(device_train_microbatch_size=3, precision="amp_bf16")
    assert later.state.precision == "amp_bf16" and later.state.device_train_microbatch_size == 3
    for name, value in params(built.state.model).items():
        assert torch.equal(params(later.state.model)[name], value), name


def test_fit_arguments_that_need_another_are_one_line_errors() -> None:
    built, _ = trainer(max_duration="2ba")
    assert error_of(built.fit, scale_schedule_ratio=2.0) == (
        "fit(scale_schedule_ratio=...) needs fit(schedulers=...): it stretches those schedulers and the duration "
        "together")
    assert error_of(built.fit, step_schedulers_every_batch=True).startswith(
        "fit(step_schedulers_every_batch=...) needs fit(schedulers=...)")
    assert error_of(built.fit, precision="fp64") == (
        "precision='fp64' is not supported; use one of fp32, amp_bf16, amp_fp16")
    assert error_of(built.fit, device_train_microbatch_size=0) == (
        "device_train_microbatch_size must be an integer >= 1 or 'auto', got 0")
    with pytest.warns(UserWarning, match="apply to fit\\(eval_dataloader=...\\)"):
        built.fit(eval_interval="1ba")
    assert built.state.timestamp.batch == 2


def test_a_fit_that_fails_its_checks_changes_nothing() -> None:
    built, seen = trainer(max_duration="2ba")
    built.fit()
    before = (built.state.timestamp, built.state.max_duration, built.train_dataloader, built.state.schedulers,
              built.loop.device_train_microbatch_size, built.state.batches_per_epoch)
    for bad in (dict(duration="2ba", device_train_microbatch_size=0),
                dict(duration="2ba", reset_time=True, train_subset_num_batches=-5),
                dict(duration="2ba", train_dataloader=loader(7), train_dataloader_label=""),
                dict(duration="2ba", schedulers=LinearScheduler(), step_schedulers_every_batch="yes")):
        assert error_of(built.fit, **bad) != "no error", bad
        after = (built.state.timestamp, built.state.max_duration, built.train_dataloader, built.state.schedulers,
                 built.loop.device_train_microbatch_size, built.state.batches_per_epoch)
        assert after == before, bad
    assert seen.labels == ["train"] * 2


def test_fsdp_keeps_the_trainers_precision() -> None:
    built, _ = trainer(max_duration="2ba", fsdp_config={"sharding_strategy": "FULL_SHARD"})
    assert error_of(built.fit, precision="amp_bf16") == (
        "fit(precision='amp_bf16'): under FSDP or DeepSpeed the precision is part of the wrapped model, fixed at "
        "Trainer(precision='fp32'); give it there")
    assert built.state.max_duration == "2ba"
    assert error_of(built.fit, duration="1ba", precision="amp_bf16").startswith("fit(precision='amp_bf16')")
    assert built.state.max_duration == "2ba"  # the refused fit changed nothing
    built.fit(precision="fp32")  # the Trainer's: nothing to change
    assert built.state.timestamp.batch == 2
