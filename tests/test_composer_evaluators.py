"""Composer's Evaluator and DataSpec, and the CheckpointSaver and LoadCheckpoint callbacks, in the
Trainer (one process; tests/test_composer_notebooks.py runs Composer's own code with them on 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import lockstep
from lockstep import Callback, DataSpec, Evaluator, Trainer
from lockstep.callbacks import CheckpointSaver, LoadCheckpoint
from lockstep.core.eval_metrics import values
from lockstep.loggers import InMemoryLogger
from tests.trainer.common import MLP, dataset, error_of, loader, params


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


class Evaluated(Callback):
    """The label and batch of each evaluation."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def eval_end(self, state, logger) -> None:
        self.seen.append((state.dataloader_label, state.timestamp.batch.value))


def test_composers_paths_hold_the_same_classes() -> None:
    import lockstep.core
    import lockstep.core.data_spec
    import lockstep.core.evaluator

    assert lockstep.Evaluator is lockstep.core.Evaluator is lockstep.core.evaluator.Evaluator
    assert lockstep.DataSpec is lockstep.core.DataSpec is lockstep.core.data_spec.DataSpec


def test_each_evaluator_has_its_interval_subset_metrics_and_logged_names() -> None:
    model, logger, evaluated = MLP(train_accuracy=True), InMemoryLogger(), Evaluated()
    often = Evaluator(label="often", dataloader=loader(4), eval_interval="2ba", subset_num_batches=1)
    rare = Evaluator(label="rare", dataloader=DataSpec(loader(7)), metric_names=["ACC"])  # regex, any case
    never = Evaluator(label="never", dataloader=loader(7), eval_interval=0)
    trainer = Trainer(model=model, train_dataloader=loader(7), max_duration="2ep", optimizers=sgd(model),
                      eval_dataloader=[often, rare, never], loggers=[logger], callbacks=[evaluated],
                      progress_bar=False)
    trainer.fit()
    assert evaluated.seen == [("often", 2), ("often", 4), ("rare", 4), ("often", 6), ("often", 8), ("rare", 8)]
    assert set(trainer.state.eval_metrics) == {"often", "rare", "never"}
    assert set(trainer.state.eval_metrics["rare"]) == {"accuracy", "loss"}
    # the model's training metrics too (its get_metrics gives them for is_train=True), as in Composer
    assert {k for k in logger.data if k.startswith("metrics/")} == {"metrics/often/accuracy", "metrics/rare/accuracy",
                                                                    "metrics/train/accuracy"}
    # the subset: 'often' saw the first batch of 4 only
    first = Trainer(model=model, eval_dataloader=DataLoader(torch.utils.data.Subset(dataset(), range(4)),
                                                            batch_size=4), progress_bar=False).eval()["eval"]
    assert values({"often": trainer.state.eval_metrics["often"]})["often"] == first
    results = trainer.eval()  # every evaluator, 'never' too
    assert set(results) == {"often", "rare", "never"}
    assert results["never"] == results["rare"] | {"loss": results["never"]["loss"]}


def test_fit_evaluates_once_more_at_its_end_as_composer_does() -> None:
    # what Composer 0.32.1 records for this run (4 batches an epoch, 10 then 2 more): at the end of
    # each fit, every evaluator with a Time interval whose last batch did not evaluate evaluates
    model, evaluated = MLP(), Evaluated()
    evaluators = [Evaluator(label=label, dataloader=loader(7), eval_interval=interval)
                  for label, interval in [("ep", "1ep"), ("b3", "3ba"), ("b5", "5ba"), ("zero", 0)]]
    trainer = Trainer(model=model, train_dataloader=loader(7), max_duration="10ba", optimizers=sgd(model),
                      eval_dataloader=evaluators, callbacks=[evaluated], progress_bar=False)
    trainer.fit()
    assert evaluated.seen == [("b3", 3), ("ep", 4), ("b5", 5), ("b3", 6), ("ep", 8), ("b3", 9), ("b5", 10),
                              ("ep", 10), ("b3", 10)]
    trainer.fit(duration="2ba")
    assert evaluated.seen[9:] == [("b3", 12), ("ep", 12), ("b5", 12)]
    with pytest.raises(ValueError, match="No training would occur"):  # nothing left to train: refused, as Composer
        trainer.fit()
    assert len(evaluated.seen) == 12


def test_the_last_evaluation_reaches_the_run_folders_metrics(tmp_path: Path) -> None:
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(7), max_duration="3ba", optimizers=sgd(model),
                      eval_dataloader=loader(7), eval_interval="2ba", run_folder=str(tmp_path), progress_bar=False)
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in records if r["kind"] == "eval"] == [2, 3]


def test_an_evaluation_before_fit_is_the_first_record_of_the_run_folders_metrics(tmp_path: Path) -> None:
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(7), max_duration="2ba", optimizers=sgd(model),
                      eval_dataloader=loader(7), eval_interval="2ba", run_folder=str(tmp_path), progress_bar=False)
    before = trainer.eval()["eval"]
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["batch"]) for r in records] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    assert records[0]["loss"] == pytest.approx(before["loss"])


def test_eval_microbatches_give_the_whole_batchs_metrics() -> None:
    model = MLP()
    whole = Trainer(model=model, eval_dataloader=loader(8), progress_bar=False).eval()["eval"]
    pieces = Trainer(model=model, eval_dataloader=Evaluator(label="eval", dataloader=loader(8),
                                                            device_eval_microbatch_size=3),
                     progress_bar=False).eval()["eval"]
    assert pieces["accuracy"] == whole["accuracy"]
    assert pieces["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_a_train_dataspec_counts_splits_and_transforms_batches() -> None:
    """A batch the model cannot count (a dict with a string) trains through a DataSpec's rules, and
    its transforms act: equal to plain batches with the transform applied beforehand."""
    x, y = dataset(32).tensors
    plain = [(2 * x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    dicts = [{"x": x[i:i + 8], "y": y[i:i + 8], "tag": "kept"} for i in range(0, 32, 8)]
    split_sizes = []

    def split(batch, size):
        split_sizes.append(size)
        return [{k: (v[j:j + size] if torch.is_tensor(v) else v) for k, v in batch.items()} for j in range(0, 8, size)]

    spec = DataSpec(dicts, batch_transforms=lambda b: {**b, "x": 2 * b["x"]},
                    microbatch_transforms=lambda b: (b["x"], b["y"]), split_batch=split,
                    get_num_samples_in_batch=lambda b: len(b["y"]))
    reference, model = MLP(), MLP()
    Trainer(model=reference, train_dataloader=plain, max_duration="1ep", optimizers=sgd(reference),
            progress_bar=False).fit()
    trainer = Trainer(model=model, train_dataloader=spec, max_duration="1ep", optimizers=sgd(model),
                      device_train_microbatch_size=3, progress_bar=False)
    trainer.fit()
    assert trainer.state.timestamp.sample == 32 and split_sizes == [3] * 4
    for k, v in params(reference).items():
        torch.testing.assert_close(v, params(model)[k], rtol=0, atol=1e-6)


def test_evaluator_and_dataspec_errors_are_one_line() -> None:
    model = MLP()
    cases = [
        (lambda: Evaluator(label="", dataloader=loader(4)), "give a non-empty name"),
        (lambda: Evaluator(label="a", dataloader=loader(4), metric_names="accuracy"), "must be a list of strings"),
        (lambda: Evaluator(label="a", dataloader=loader(4), device_eval_microbatch_size="auto"), "no 'auto'"),
        (lambda: Evaluator(label="a", dataloader=loader(4), subset_num_batches=0), "must be -1"),
        (lambda: DataSpec(loader(4), split_batch=3), "must be a function"),
        (lambda: Trainer(model=model, eval_dataloader=[Evaluator(label="a", dataloader=loader(4))] * 2), "repeat"),
    ]
    for make, message in cases:
        error = error_of(make)
        assert message in error and "\n" not in error, error


def _classifier_run(tmp_path: Path, max_duration: str = "2ep", **kwargs) -> Trainer:
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(7), max_duration=max_duration, optimizers=sgd(model),
                   progress_bar=False, run_name="r", **kwargs)


def test_checkpoint_saver_callback_saves_as_the_trainers_save_arguments(tmp_path: Path) -> None:
    saver = CheckpointSaver(folder=str(tmp_path / "cb"), save_interval="3ba", num_checkpoints_to_keep=2)
    with_callback = _classifier_run(tmp_path, callbacks=[saver])
    with_callback.fit()
    with_arguments = _classifier_run(tmp_path, save_folder=str(tmp_path / "args"), save_interval="3ba",
                                     save_num_checkpoints_to_keep=2)
    with_arguments.fit()
    names = sorted(p.name for p in (tmp_path / "cb").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "args").iterdir())
    assert names == ["ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt", "latest-rank0.pt"]  # 4 batches an epoch
    assert saver.saved_checkpoints == with_callback.saved_checkpoints and len(saver.saved_checkpoints) == 3
    # As in Composer, the first CheckpointSaver's folder is the run's save_folder
    first = CheckpointSaver(folder=str(tmp_path / "first"), save_interval="4ba")
    _classifier_run(tmp_path, callbacks=[first], save_folder=str(tmp_path / "x")).fit()
    assert not (tmp_path / "x").exists()
    assert sorted(p.name for p in (tmp_path / "first").iterdir()) == \
        ["ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt", "latest-rank0.pt"]
    assert CheckpointSaver(ignore_keys=["rng"]).trainer_arguments()["save_ignore_keys"] == ["rng"]
    assert "save_filename" in error_of(CheckpointSaver, filename="ep{nonsense}.pt")


def test_several_checkpoint_savers_each_save_on_their_own_terms(tmp_path: Path) -> None:
    run = CheckpointSaver(folder=str(tmp_path / "run"))
    weights = CheckpointSaver(folder=str(tmp_path / "weights"), filename="ba{batch}.pt", latest_filename=None,
                              save_interval="2ba", num_checkpoints_to_keep=2, weights_only=True)
    trainer = _classifier_run(tmp_path, callbacks=[run, weights])  # 4 batches an epoch
    trainer.fit()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == \
        ["ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt", "latest-rank0.pt"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["ba6.pt", "ba8.pt"]
    assert [Path(p).name for p in weights.saved_checkpoints] == ["ba2.pt", "ba4.pt", "ba6.pt", "ba8.pt"]
    assert list(weights.all_saved_checkpoints_to_timestamp) == ["ba6.pt", "ba8.pt"]  # rotation dropped the rest
    saved = torch.load(tmp_path / "weights" / "ba8.pt", weights_only=True)
    live = trainer.state.model.state_dict()
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in live)
    assert trainer.saved_checkpoints == run.saved_checkpoints and len(run.saved_checkpoints) == 2


def test_a_checkpoint_records_the_run_s_saves_where_composer_keeps_them(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    first = _classifier_run(tmp_path, max_duration="1ep", save_folder=str(folder), save_interval="2ba",
                            autoresume=True)
    first.fit()
    first.close()
    content = torch.load(folder / "ep1-ba4-rank0.pt", weights_only=True)
    assert content["state"]["run_name"] == "r" and not {"run_name", "history"} & content["lockstep"].keys()
    record = content["state"]["callbacks"]["CheckpointSaver"]["all_saved_checkpoints_to_timestamp"]
    assert [(name, saved["batch"]) for name, saved in record] == [("ep0-ba2-rank0.pt", 2), ("ep1-ba4-rank0.pt", 4)]
    resumed = _classifier_run(tmp_path, max_duration="2ep", save_folder=str(folder), save_interval="2ba",
                              autoresume=True, save_num_checkpoints_to_keep=3)
    resumed.fit()
    record = torch.load(folder / "ep2-ba8-rank0.pt", weights_only=True)["state"]["callbacks"]["CheckpointSaver"]
    names = [name for name, _ in record["all_saved_checkpoints_to_timestamp"]]
    assert names == ["ep1-ba4-rank0.pt", "ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt"]  # continued, then rotated
    assert sorted(p.name for p in folder.glob("ep*")) == sorted(names)


class Stateful(Callback):
    def state_dict(self) -> dict:
        return {"seen": 1}


def test_leaving_the_callbacks_out_of_checkpoints_keeps_the_save_record(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    kept = dict(save_folder=str(folder), save_interval="2ba", autoresume=True, save_num_checkpoints_to_keep=2,
                save_ignore_keys=["state/callbacks/*"], callbacks=[Stateful()])
    _classifier_run(tmp_path, max_duration="1ep", **kept).fit()
    content = torch.load(folder / "ep1-ba4-rank0.pt", weights_only=True)
    assert list(content["state"]["callbacks"]) == ["CheckpointSaver"]  # Stateful's state is left out
    _classifier_run(tmp_path, max_duration="2ep", **kept).fit()  # resumed: its rotation goes on
    assert sorted(p.name for p in folder.glob("ep*")) == ["ep1-ba6-rank0.pt", "ep2-ba8-rank0.pt"]


def test_load_checkpoint_callback_resumes_exactly_and_loads_weights_at_an_event(tmp_path: Path) -> None:
    whole = _classifier_run(tmp_path, save_folder=str(tmp_path / "ck"), save_interval="3ba")
    whole.fit()
    middle = whole.saved_checkpoints[0]  # ep0-ba3: mid-epoch
    resumed = _classifier_run(tmp_path, callbacks=[LoadCheckpoint(middle)])
    assert resumed.state.timestamp.batch == 3
    resumed.fit()
    assert all(torch.equal(a, b) for a, b in zip(params(whole.state.model).values(),
                                                  params(resumed.state.model).values()))
    # weights only, at FIT_START: the run starts at batch 0 from the saved weights
    started = []
    late = LoadCheckpoint(whole.saved_checkpoints[-1], load_weights_only=True, event="fit_start")
    probe = type("Probe", (Callback,), {"fit_start": lambda self, s, lg: started.append(params(s.model))})()
    fresh = _classifier_run(tmp_path, callbacks=[late, probe], max_duration="1ba")
    fresh.fit()
    assert fresh.state.timestamp.batch == 1
    saved = lockstep.checkpoint.export_state_dict(whole.saved_checkpoints[-1])
    assert all(torch.equal(started[0][k], v) for k, v in saved.items())
    assert "BEFORE_LOAD or AFTER_LOAD" in error_of(LoadCheckpoint, middle, event="fit_start")
    assert "not an event" in error_of(LoadCheckpoint, middle, event="someday")
    for uri in ("s3://b/ck.pt", "azure://c/ck.pt", "az://c/ck.pt", "https://h/ck.pt"):  # one line, whatever bucket
        assert "lockstep loads checkpoints from local paths" in error_of(LoadCheckpoint, uri), uri


def _save_metrics_before_any_evaluation(folder: str) -> list[str]:
    model = MLP()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="2ba", optimizers=sgd(model),
                      eval_dataloader=loader(4), eval_interval="1ep", save_folder=folder, save_interval="1ba",
                      save_metrics=True, progress_bar=False, run_name="r")
    trainer.fit()  # rank 0 writes each checkpoint: reading metrics never evaluated must not gather
    trainer.eval()
    return sorted(values(trainer.state.eval_metrics)["eval"])


@pytest.mark.timeout(120)
def test_save_metrics_before_the_first_evaluation_on_two_ranks(tmp_path: Path) -> None:
    from lockstep.testing import run_distributed

    results = run_distributed(_save_metrics_before_any_evaluation, world_size=2, args=(str(tmp_path),), timeout=100)
    assert results == [["accuracy", "loss"]] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt", "latest-rank0.pt"]


def test_plain_dataloaders_in_a_list_are_each_an_eval_evaluator_as_in_composer() -> None:
    model = MLP()
    trainer = Trainer(model=model, eval_dataloader=[loader(4), loader(8), Evaluator(label="a", dataloader=loader(4))],
                      progress_bar=False)
    assert [e.label for e in trainer.state.evaluators] == ["eval", "eval", "a"]
    results = trainer.eval()
    assert set(results) == {"eval", "a"}


def test_an_empty_eval_dataloader_is_one_warning_naming_the_evaluator(tmp_path: Path) -> None:
    empty = DataLoader(dataset(0), batch_size=4)
    trainer = _classifier_run(tmp_path, max_duration="1ba", eval_dataloader=Evaluator(label="held", dataloader=empty))
    with pytest.warns(UserWarning) as caught:
        trainer.fit()
    said = [str(w.message) for w in caught]
    assert said == ["evaluator 'held' had no batch to evaluate on rank 0: its dataloader yields none here (check its "
                    "dataset, batch_size and sampler); its metrics count the other ranks' samples only"], said
