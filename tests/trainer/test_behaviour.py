"""Durations, data rules, evaluation, logging and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from lockstep import Callback, Trainer
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, dataset, loader, params, sgd


class TokenMLP(MLP):
    def num_tokens(self, batch):
        return 10 * batch[0].shape[0]


def fit_steps(max_duration: str, model_cls=MLP, **kwargs) -> Trainer:
    model = model_cls()
    trainer = Trainer(model=model, train_dataloader=loader(16, n=64), max_duration=max_duration,
                      optimizers=sgd(model), progress_bar=False, **kwargs)
    trainer.fit()
    return trainer


@pytest.mark.parametrize(("duration", "batches", "epochs"), [
    ("40sp", 3, 0),      # 16, 32, 48 >= 40
    ("2ba", 2, 0),
    ("1ep", 4, 1),
    ("3ep", 12, 3),
    ("350tok", 3, 0),    # 160 tokens per batch: 480 >= 350
])
def test_each_duration_unit_stops_at_the_right_step(duration, batches, epochs) -> None:
    trainer = fit_steps(duration, model_cls=TokenMLP)
    assert (trainer.state.timestamp.batch, trainer.state.timestamp.epoch) == (batches, epochs)
    assert trainer.state.timestamp.sample == 16 * batches
    assert trainer.state.timestamp.token == 160 * batches


class RankTokenMLP(MLP):
    """Ranks count different tokens per sample (10 on rank 0, 30 on rank 1): only a sum tells."""

    def num_tokens(self, batch):
        from lockstep import dist
        return (10 + 20 * dist.get_global_rank()) * batch[0].shape[0]


class RankTokenLoader(DataLoader):
    @staticmethod
    def get_num_tokens_in_batch(batch):
        from lockstep import dist
        return (10 + 20 * dist.get_global_rank()) * batch[0].shape[0]


def _token_totals(counter: str) -> list[tuple[int, int, int]]:
    from lockstep import dist
    seen = []

    class Record(Callback):
        def batch_end(self, state, logger):
            seen.append((state.timestamp.batch, state.timestamp.sample, state.timestamp.token))

    model = RankTokenMLP() if counter == "model" else MLP()
    ds = dataset(64)
    cls = RankTokenLoader if counter == "loader" else DataLoader
    train = cls(ds, batch_size=8, sampler=dist.get_sampler(ds))  # 4 equal batches per rank and epoch
    Trainer(model=model, train_dataloader=train, max_duration="1000tok", optimizers=sgd(model),
            progress_bar=False, callbacks=[Record()]).fit()
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("counter", ["model", "loader"])
def test_tokens_that_differ_by_rank_are_summed_over_the_ranks(counter) -> None:
    # 8 samples a rank: 80 + 240 tokens a step; 1000 tokens are reached at the 4th step (1280)
    expected = [(1, 16, 320), (2, 32, 640), (3, 48, 960), (4, 64, 1280)]
    assert run_distributed(_token_totals, world_size=2, args=(counter,), timeout=100) == [expected, expected]


def test_the_epoch_is_counted_at_epoch_end_as_in_composer() -> None:
    seen = []

    class Record(Callback):
        def batch_end(self, state, logger):
            seen.append(("batch_end", state.timestamp.epoch, state.timestamp.batch))

        def epoch_end(self, state, logger):
            seen.append(("epoch_end", state.timestamp.epoch, state.timestamp.batch))

    fit_steps("2ep", callbacks=[Record()])
    assert seen == [("batch_end", 0, 1), ("batch_end", 0, 2), ("batch_end", 0, 3), ("batch_end", 0, 4),
                    ("epoch_end", 1, 4), ("batch_end", 1, 5), ("batch_end", 1, 6), ("batch_end", 1, 7),
                    ("batch_end", 1, 8), ("epoch_end", 2, 8)]


def test_set_epoch_is_called_every_epoch() -> None:
    model = MLP()
    dl = loader(16, n=64, shuffle=True)
    epochs = []
    original = dl.sampler.set_epoch
    dl.sampler.set_epoch = lambda e: (epochs.append(e), original(e))
    Trainer(model=model, train_dataloader=dl, max_duration="3ep", optimizers=sgd(model), progress_bar=False).fit()
    assert epochs == [0, 1, 2]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"precision": "fp64"}, "precision='fp64' is not supported; use one of fp32, amp_bf16, amp_fp16"),
    ({"device": "tpu"}, "device='tpu' is not supported"),
    ({"ddp_sync_strategy": "sometimes"}, "ddp_sync_strategy='sometimes' is not supported; use one of single_auto_sync"),
    ({"max_duration": "3xx"}, "max_duration='3xx': invalid duration '3xx'"),
    ({"max_duration": "-1ep"}, "max_duration='-1ep'"),
    ({"max_duration": "ep"}, "max_duration='ep'"),
    ({"max_duration": "0.5dur"}, "max_duration cannot be in 'dur'"),
    ({"max_duration": "0ba"}, "max_duration must be positive"),
    ({"device_train_microbatch_size": 0}, "device_train_microbatch_size must be an integer >= 1"),
    ({"grad_accum": -2}, "grad_accum must be an integer >= 1"),
    ({"device_train_microbatch_size": 2, "grad_accum": 2}, "not both"),
    ({"eval_interval": "0ep"}, "eval_interval must be positive"),
    ({"eval_interval": "abc"}, "eval_interval='abc': invalid duration 'abc'"),
    ({"save_folder": "unused", "save_interval": "abc"}, "save_interval='abc': invalid duration 'abc'"),
    ({"train_subset_num_batches": 0}, "train_subset_num_batches must be an integer >= 1, or -1"),
    ({"scale_schedule_ratio": -1.0}, "scale_schedule_ratio must be a positive finite number"),
])
def test_bad_arguments_are_named(kwargs, message) -> None:
    model = MLP()
    args = {"model": model, "train_dataloader": loader(4), "max_duration": "1ep", "optimizers": sgd(model),
            "progress_bar": False, **kwargs}
    with pytest.raises(ValueError) as info:
        Trainer(**args)
    assert message in str(info.value)


def test_an_int_max_duration_counts_epochs() -> None:
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration=2, optimizers=sgd(model),
                      progress_bar=False)
    trainer.fit()
    assert (trainer.state.timestamp.epoch, trainer.state.timestamp.batch) == (2, 2 * len(loader(4)))


def test_subsets_of_the_train_and_eval_dataloaders() -> None:
    """3 of 7 batches per epoch for 2 epochs; evaluation on the first batch of 4 samples only."""
    model = MLP()
    seen = []
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="2ep", optimizers=sgd(model),
                      eval_dataloader=loader(4), train_subset_num_batches=3, eval_subset_num_batches=1,
                      callbacks=[type("Seen", (Callback,), {"batch_end": lambda self, s, logger: seen.append(
                          (s.timestamp.epoch, s.timestamp.batch_in_epoch))})()], progress_bar=False)
    trainer.fit()
    assert seen == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]  # the epoch moves on at EPOCH_END
    assert trainer.state.batches_per_epoch == 3
    first_batch = Trainer(model=model, train_dataloader=loader(4), optimizers=sgd(model), progress_bar=False,
                          eval_dataloader=DataLoader(Subset(dataset(), range(4)), batch_size=4)).eval()
    # state.eval_metrics is Composer's {label: {name: Metric}}; eval() returns their values
    assert {name: float(m.compute()) for name, m in trainer.state.eval_metrics["eval"].items()} == first_batch["eval"]
    assert trainer.eval(subset_num_batches=-1) == first_batch  # Composer: -1 is the evaluator's subset
    assert trainer.eval(subset_num_batches=7) != first_batch  # every batch


def test_fit_with_a_duration_continues_the_epoch_and_lists_saved_checkpoints(tmp_path: Path) -> None:
    """Composer's fit(duration=): that much more time; an int counts epochs; reset_time starts over."""
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), optimizers=sgd(model), progress_bar=False,
                      save_folder=str(tmp_path), save_interval="2ba")
    trainer.fit(duration="3ba")
    assert trainer.state.timestamp.batch == 3
    trainer.fit(duration=1)  # to the end of epoch 1: the 4 batches left of the first epoch
    assert (trainer.state.timestamp.epoch, trainer.state.timestamp.batch) == (1, 7)
    names = [Path(p).name for p in trainer.saved_checkpoints]
    assert names == ["ep0-ba2-rank0.pt", "ep0-ba3-rank0.pt", "ep0-ba4-rank0.pt", "ep0-ba6-rank0.pt",
                     "ep1-ba7-rank0.pt"]
    # the same parameters as one uninterrupted epoch
    reference = MLP()
    Trainer(model=reference, train_dataloader=loader(4), optimizers=sgd(reference), progress_bar=False,
            max_duration="1ep").fit()
    for k, v in params(reference).items():
        torch.testing.assert_close(v, params(model)[k], rtol=0, atol=0)
    fresh = MLP()
    again = Trainer(model=fresh, train_dataloader=loader(4), optimizers=sgd(fresh), progress_bar=False)
    again.fit(duration="2ba")
    again.fit(duration="3ba", reset_time=True, train_dataloader=loader(2))
    assert again.state.timestamp.batch == 3 and again.state.batches_per_epoch == 14
    assert "duration cannot be in 'dur'" in str(pytest.raises(ValueError, again.fit, duration="0.5dur").value)


def test_optimizer_without_the_models_parameters_is_refused() -> None:
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(SGD\) holds none of the model's parameters"):
        Trainer(model=MLP(), train_dataloader=loader(4), max_duration="1ep", optimizers=sgd(other))


def test_grad_accum_matches_device_microbatch_size() -> None:
    a = fit_steps("1ep", grad_accum=4)
    b = fit_steps("1ep", device_train_microbatch_size=4)
    for k, v in params(a.state.model).items():
        torch.testing.assert_close(v, params(b.state.model)[k], rtol=0, atol=1e-6)


def test_dict_batches_are_split(tmp_path: Path) -> None:
    class DictMLP(MLP):
        def forward(self, batch):
            return super().forward((batch["x"],))

        def loss(self, outputs, batch):
            return torch.nn.functional.cross_entropy(outputs, batch["y"])

        def update_metric(self, batch, outputs, metric):  # its training metric reads the dict batch too
            metric.update(outputs.argmax(dim=1), batch["y"])

    x, y = dataset(32).tensors
    batches = [{"x": x[i:i + 8], "y": y[i:i + 8], "name": "kept"} for i in range(0, 32, 8)]
    ref, micro = DictMLP(), DictMLP()
    Trainer(model=ref, train_dataloader=batches, max_duration="1ep", optimizers=sgd(ref), progress_bar=False).fit()
    Trainer(model=micro, train_dataloader=batches, max_duration="1ep", optimizers=sgd(micro), progress_bar=False,
            device_train_microbatch_size=3).fit()
    for k, v in params(ref).items():
        torch.testing.assert_close(v, params(micro)[k], rtol=0, atol=1e-6)


def _eval_and_refusal():
    from lockstep import dist
    model = MLP()
    ds = dataset(7)  # 7 samples over 2 ranks: the sampler repeats one to pad
    eval_dl = DataLoader(ds, batch_size=3, sampler=dist.get_sampler(ds, shuffle=False))
    trainer = Trainer(model=model, eval_dataloader=eval_dl, progress_bar=False)
    results = trainer.eval()["eval"]  # {label: {name: value}}
    try:
        Trainer(model=model, train_dataloader=DataLoader(ds, batch_size=2), max_duration="1ep",
                optimizers=sgd(model))
    except ValueError as e:
        refusal = str(e)
    else:
        refusal = None
    return results, refusal


@pytest.mark.timeout(180)
def test_eval_over_padded_sampler_equals_one_process_and_sampler_refusal() -> None:
    model = MLP()
    expected = Trainer(model=model, eval_dataloader=DataLoader(dataset(7), batch_size=7),
                       progress_bar=False).eval()["eval"]
    for results, refusal in run_distributed(_eval_and_refusal, world_size=2, timeout=150):
        assert results.keys() == {"loss", "accuracy"}
        assert results["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-7)
        assert results["loss"] == pytest.approx(expected["loss"], abs=1e-6)
        assert refusal is not None and "lockstep.dist.get_sampler" in refusal and "train_dataloader" in refusal


def test_run_folder_gets_rank_log_metrics_and_loss_curve(tmp_path: Path) -> None:
    model = MLP()
    Trainer(model=model, train_dataloader=loader(8), eval_dataloader=loader(8), max_duration="2ep",
            optimizers=sgd(model), run_folder=str(tmp_path), run_name="demo", progress_bar=True).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in records if r["kind"] == "train"] == list(range(1, 9))
    assert [r["epoch"] for r in records if r["kind"] == "eval"] == [1, 2]
    assert all(r["run_name"] == "demo" for r in records)
    assert "ep 2 ba 8" in (tmp_path / "trainer-rank0.log").read_text()
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_buffered_logs_are_written_when_fit_raises(tmp_path: Path) -> None:
    class Boom(Callback):
        def batch_start(self, state, logger) -> None:
            if state.timestamp.batch == 4:
                raise RuntimeError("boom at batch 5")

    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="2ep", optimizers=sgd(model),
                      run_folder=str(tmp_path), progress_bar=False, callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom at batch 5"):
        trainer.fit()
    # nothing reached the files before the error (they write every 100 batches); fit wrote it on its way out
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert "ep 0 ba 4 sp 16 loss" in (tmp_path / "trainer-rank0.log").read_text()


@pytest.mark.parametrize("precision", ["amp_bf16", "amp_fp16"])
def test_mixed_precision_trains_close_to_fp32(precision) -> None:
    reference = fit_steps("1ep")
    trainer = fit_steps("1ep", precision=precision)
    assert (trainer.state.scaler is not None) == (precision == "amp_fp16")
    for k, v in params(trainer.state.model).items():
        assert v.dtype == torch.float32  # autocast keeps fp32 master weights
        assert not torch.equal(v, params(reference.state.model)[k]) or "bias" in k
        torch.testing.assert_close(v, params(reference.state.model)[k], rtol=0, atol=5e-2)
