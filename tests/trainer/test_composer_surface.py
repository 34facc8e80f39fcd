"""Composer's Trainer surface: its events in its order, state.loss/outputs that callbacks may change,
a callable eval_interval, console logging, precision=None, parallelism_config, python_log_level,
torch schedulers per epoch, and a Composer-style script under two ranks checked by hand."""

from __future__ import annotations

import io
import logging
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Callback, Event, Model, Trainer, dist
from lockstep.algorithms import Algorithm
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(180)


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def run_event(self, event, state, logger) -> None:
        self.events.append(event.value)


def _trainer(**kwargs) -> Trainer:
    model = kwargs.pop("model", None) or MLP()
    kwargs.setdefault("optimizers", torch.optim.SGD(model.parameters(), lr=0.1))
    kwargs.setdefault("progress_bar", False)
    return Trainer(model=model, train_dataloader=loader(4), device="cpu", **kwargs)


def _fit(**kwargs) -> Trainer:
    trainer = _trainer(**kwargs)
    trainer.fit()
    return trainer


def test_events_fire_in_composers_order(tmp_path) -> None:
    record = Recorder()
    trainer = _trainer(max_duration="7ba", grad_accum=2, eval_dataloader=loader(14), eval_interval="7ba",
                       save_folder=str(tmp_path), save_interval="1ep", callbacks=[record])
    assert record.events == ["init", "before_load", "after_load"]
    trainer.fit()
    micro = ["before_forward", "after_forward", "before_loss", "after_loss", "before_backward", "after_backward"]
    batch = ["before_dataloader", "after_dataloader", "batch_start", "before_train_batch", *micro, *micro,
             "after_train_batch", "batch_end"]
    evaluation = ["eval_before_all", "eval_start",
                  *["eval_batch_start", "eval_before_forward", "eval_after_forward", "eval_batch_end"] * 2,
                  "eval_end", "eval_after_all"]
    first = record.events[3:3 + 3 + len(batch) + 1]
    assert first == ["fit_start", "iteration_start", "epoch_start", *batch, "batch_checkpoint"]
    # Composer's order: a batch's evaluation and checkpoint event come before the epoch's end
    last = ["before_dataloader", "after_dataloader", "batch_start", "before_train_batch", *micro, *micro,
            "after_train_batch", "batch_end", *evaluation, "batch_checkpoint",
            "before_dataloader",  # Composer asks the exhausted dataloader once more before the epoch ends
            "epoch_end", "epoch_checkpoint", "fit_end"]
    assert record.events[-len(last):] == last
    assert "iteration_end" not in record.events and "iteration_checkpoint" not in record.events
    record.events.clear()
    trainer.eval()
    assert record.events == ["eval_standalone_start", *evaluation[1:-1], "eval_standalone_end"]


class Timestamps(Callback):
    """Where each event of the epoch's end sees the timestamp, as (epoch, batch_in_epoch)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    def run_event(self, event, state, logger) -> None:
        if event.value in ("batch_end", "batch_checkpoint", "epoch_end", "eval_start", "epoch_checkpoint",
                           "epoch_start", "iteration_start"):
            t = state.timestamp
            self.seen.append((event.value, t.epoch, t.batch_in_epoch))


def test_the_epoch_counts_from_epoch_end_and_epoch_evaluations_and_saves_follow_it(tmp_path) -> None:
    record = Timestamps()
    trainer = _trainer(max_duration="2ep", eval_dataloader=loader(14), eval_interval="1ep",
                       save_folder=str(tmp_path), save_interval="7ba", callbacks=[record])
    trainer.fit()
    end_of_first = record.seen[record.seen.index(("batch_end", 0, 7)):][:6]
    assert end_of_first == [("batch_end", 0, 7), ("batch_checkpoint", 0, 7), ("epoch_end", 1, 0),
                            ("eval_start", 1, 0), ("epoch_checkpoint", 1, 0), ("epoch_start", 1, 0)]
    assert record.seen[0] == ("iteration_start", 0, 0)
    assert [e for e, *_ in record.seen].count("iteration_start") == 1
    # a batch interval due at the epoch's last batch saves once the epoch is counted: {epoch} says 1
    assert [p.rsplit("/", 1)[1] for p in trainer.saved_checkpoints] == ["ep1-ba7-rank0.pt", "ep2-ba14-rank0.pt"]


class Predictions(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.training: list[bool] = []

    def run_event(self, event, state, logger) -> None:
        if event.value.startswith("predict"):
            self.events.append(event.value)
            self.training.append(state.model.training)


def test_predict_returns_each_batchs_outputs_with_composers_events() -> None:
    record = Predictions()
    model = MLP()
    trainer = _trainer(model=model, max_duration="1ba", callbacks=[record])
    batches = list(loader(4))[:3]
    outputs = trainer.predict(batches)
    assert len(outputs) == 3 and all(not o.requires_grad for o in outputs)
    with torch.no_grad():
        expected = [model(b) for b in batches]
    assert all(torch.equal(o, e) for o, e in zip(outputs, expected, strict=True))
    per_batch = ["predict_batch_start", "predict_before_forward", "predict_after_forward", "predict_batch_end"]
    assert record.events == ["predict_start", *per_batch * 3, "predict_end"]
    assert not any(record.training) and model.training  # eval mode inside, train mode restored
    assert trainer.predict(batches, subset_num_batches=2, return_outputs=False) == []
    assert record.events.count("predict_batch_end") == 5
    with pytest.raises(ValueError, match="subset_num_batches must be an integer >= 1"):
        trainer.predict(batches, subset_num_batches=0)


class ZeroLoss(Callback):
    """Replaces each microbatch's loss at AFTER_LOSS, as a Composer algorithm may."""

    def after_loss(self, state, logger) -> None:
        assert state.outputs is not None and state.outputs.shape[0] == state.batch[0].shape[0]
        state.loss = state.loss * 0.0


def test_a_loss_replaced_at_after_loss_is_what_is_backpropagated() -> None:
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model=model, max_duration="3ba", callbacks=[ZeroLoss()])
    trainer.fit()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # zero gradients: SGD moved nothing
    assert float(trainer.state.loss) == 0.0


def test_callable_eval_interval_is_asked_at_batch_end_and_epoch_end() -> None:
    asked: list[tuple[int, str]] = []

    def every_third_batch_and_each_epoch(state, event) -> bool:
        asked.append((state.timestamp.batch, event.value))
        return (event is Event.BATCH_END and state.timestamp.batch % 3 == 0) or event is Event.EPOCH_END

    record = Recorder()
    _trainer(max_duration="2ep", eval_dataloader=loader(14), eval_interval=every_third_batch_and_each_epoch,
             callbacks=[record]).fit()
    # 7 batches per epoch: batches 3, 6, 7 (epoch end), 9, 12, 14 (epoch end)
    assert record.events.count("eval_start") == 6
    assert (7, "epoch_end") in asked and (14, "epoch_end") in asked and (6, "epoch_end") not in asked


def test_log_to_console_prints_every_interval_and_each_evaluation() -> None:
    stream = io.StringIO()
    _trainer(max_duration="6ba", eval_dataloader=loader(14), eval_interval="3ba", log_to_console=True,
             console_log_interval="2ba", console_stream=stream).fit()
    lines = stream.getvalue().splitlines()
    train = [line for line in lines if " train " in line]
    assert [line.split("]")[1] for line in train] == ["[batch=2/6", "[batch=4/6", "[batch=6/6"]
    assert all("loss/train/total: " in line for line in train)
    evals = [line for line in lines if " eval " in line]
    assert len(evals) == 2 and "metrics/eval/accuracy: " in evals[0]


def test_precision_none_is_fp32_on_cpu() -> None:
    assert _trainer(max_duration="1ba", precision=None).state.precision == "fp32"


class RunsOutOfMemory(MLP):
    """Raises the out-of-memory error torch raises, for microbatches above a size per rank."""

    def __init__(self, limits: list[int]) -> None:
        super().__init__()
        self.limits = limits

    def forward(self, batch):
        if batch[0].shape[0] > self.limits[dist.get_global_rank()]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return super().forward(batch)


def _auto(limits: list[int]) -> tuple[int | None, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    searched = _fit(model=RunsOutOfMemory(limits), max_duration="2ep", device_train_microbatch_size="auto")
    fixed = _fit(model=MLP(), max_duration="2ep", device_train_microbatch_size=1)
    return searched.state.device_train_microbatch_size, dict(searched.state.model.state_dict()), \
        dict(fixed.state.model.state_dict())


def test_auto_microbatching_halves_on_every_rank_until_no_rank_runs_out_of_memory() -> None:
    # rank 1 fits 1 sample, rank 0 fits 4: both end at 1 (they agree), and train as with size 1
    for size, searched, fixed in run_distributed(_auto, world_size=2, args=([4, 1],)):
        assert size == 1
        assert all(torch.allclose(searched[k], fixed[k], atol=1e-6) for k in fixed)
    message = error_of(_fit, model=RunsOutOfMemory([0]), max_duration="1ba", device_train_microbatch_size="auto")
    assert "ran out of memory with a microbatch of 1 sample" in message


def test_python_log_level() -> None:
    _trainer(max_duration="1ba", python_log_level="debug")
    assert logging.getLogger("lockstep").level == logging.DEBUG
    assert "is not a logging level" in error_of(_trainer, max_duration="1ba", python_log_level="loud")
    logging.getLogger("lockstep").setLevel(logging.NOTSET)


def _parallelism(_: int) -> tuple[str, str, str]:
    trainer = _trainer(max_duration="1ba", parallelism_config={"fsdp": {"sharding_strategy": "SHARD_GRAD_OP"}})
    both = error_of(_trainer, max_duration="1ba", parallelism_config={"fsdp": {}}, fsdp_config={})
    from torch.distributed.tensor.parallel import ColwiseParallel
    tp = error_of(_trainer, max_duration="1ba", parallelism_config={
        "tp": {"tensor_parallel_degree": 2, "layer_plan": {"fc1": ColwiseParallel()}}})
    weights = error_of(_trainer, max_duration="1ba", parallelism_config={"fsdp": {"state_dict_type": "sharded"}},
                       save_folder=tempfile.mkdtemp(), save_weights_only=True)
    auto = error_of(_trainer, max_duration="1ba", parallelism_config={"fsdp": {}}, device_train_microbatch_size="auto")
    return type(trainer.strategy).__name__, both, tp, weights + "\n" + auto


def test_parallelism_config_is_where_composer_0_32_keeps_the_fsdp_settings() -> None:
    name, both, tp, weights = run_distributed(_parallelism, world_size=2, args=(0,))[0]
    assert "FSDP" in name
    assert both.startswith("give the FSDP settings once")
    assert tp.startswith("tensor parallelism shards the rest of the model with FSDP: add parallelism_config['fsdp']")
    assert weights.startswith("save_weights_only=True writes one file of full weights, but this run saves 'sharded'")
    assert "device_train_microbatch_size='auto' works under DDP and in one process" in weights


# --- a Composer-style script: the values Composer's documented semantics give, worked out by hand

class Linear(Model):
    """ComposerModel-shaped: forward(batch) and loss(outputs, batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.w.weight.copy_(torch.tensor([[0.5, -0.25]]))

    def forward(self, batch):
        return self.w(batch[0]).squeeze(1)

    def loss(self, outputs, batch):
        return torch.nn.functional.mse_loss(outputs, batch[1])


def _data() -> TensorDataset:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [1.0, -1.0], [2.0, 1.0], [1.0, 2.0]])
    return TensorDataset(x, x @ torch.tensor([1.0, 2.0]))


class LRAtBatchStart(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.epoch_ends: list[int] = []

    def batch_start(self, state, logger) -> None:
        self.lrs.append(state.optimizers[0].param_groups[0]["lr"])

    def epoch_end(self, state, logger) -> None:
        self.epoch_ends.append(state.timestamp.batch)


def _composer_script(_: int) -> tuple[list[float], list[int], list[float]]:
    data = _data()
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = LRAtBatchStart()
    trainer = Trainer(model=model, optimizers=opt, max_duration=2, device="cpu", progress_bar=False,
                      schedulers=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                      train_dataloader=DataLoader(data, batch_size=2, sampler=dist.get_sampler(data)),
                      callbacks=[record])
    trainer.fit()
    return record.lrs, record.epoch_ends, model.w.weight.detach().flatten().tolist()


def test_a_composer_style_script_gets_composers_learning_rates_and_parameters() -> None:
    results = run_distributed(_composer_script, world_size=2, args=(0,))
    lrs, epoch_ends, weight = results[0]
    # max_duration=2 is 2 epochs; 8 samples over 2 ranks in batches of 2 per rank: 2 steps per epoch.
    # StepLR is stepped once per epoch (Composer's default for a torch scheduler): 0.1, then 0.05.
    assert lrs == [0.1, 0.1, 0.05, 0.05] and epoch_ends == [2, 4]
    assert results[1] == results[0]
    # By hand: each step is plain SGD on the mean squared error over the global batch of 4 samples.
    # Rank r's sampler takes samples r, r+2, ...; step k's global batch is rank 0's and rank 1's k-th pairs.
    x, y = (t.double() for t in _data().tensors)
    w = torch.tensor([0.5, -0.25], dtype=torch.float64)
    global_batches = [[0, 2, 1, 3], [4, 6, 5, 7]]
    for lr in (0.1, 0.05):
        for idx in global_batches:
            xb, yb = x[idx], y[idx]
            grad = 2 * xb.T @ (xb @ w - yb) / len(idx)
            w = w - lr * grad
    assert weight == pytest.approx(w.tolist(), abs=1e-6)


def test_save_weights_only_writes_a_plain_state_dict_that_loads_as_weights(tmp_path) -> None:
    model = MLP()
    trainer = _trainer(model=model, max_duration="3ba", save_folder=str(tmp_path), save_interval="3ba",
                       save_weights_only=True)
    trainer.fit()
    saved = torch.load(trainer.saved_checkpoints[-1], weights_only=True)
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    fresh = MLP()
    with torch.no_grad():
        fresh.net[0].weight.zero_()
    _trainer(model=fresh, max_duration="1ba", load_path=trainer.saved_checkpoints[-1], load_weights_only=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    refused = error_of(_trainer, max_duration="1ba", load_path=trainer.saved_checkpoints[-1])
    assert "holds only model weights (a plain state_dict): pass load_weights_only=True" in refused
    both = error_of(_trainer, max_duration="1ba", save_folder=str(tmp_path / "b"), save_weights_only=True,
                    autoresume=True, run_name="r")
    assert both.startswith("autoresume=True needs full checkpoints")


def test_save_metrics_keeps_the_last_evaluation_in_the_checkpoint(tmp_path) -> None:
    from lockstep.core.eval_metrics import values

    def run(folder, save_metrics):
        trainer = _trainer(max_duration="3ba", eval_dataloader=loader(14), eval_interval="3ba",
                           save_folder=str(folder), save_interval="3ba", save_metrics=save_metrics)
        trainer.fit()
        return trainer

    # state.eval_metrics is Composer's {label: {name: Metric}}; as in Composer, a load puts the saved
    # values into the metrics of the evaluators the resumed Trainer has
    kept = run(tmp_path / "kept", True)
    assert set(kept.state.eval_metrics) == {"eval"}
    assert set(kept.state.eval_metrics["eval"]) == {"loss", "accuracy"}
    resumed = _trainer(max_duration="4ba", load_path=kept.saved_checkpoints[-1], eval_dataloader=loader(14))
    assert values(resumed.state.eval_metrics) == values(kept.state.eval_metrics)
    plain = run(tmp_path / "plain", False)
    fresh = _trainer(max_duration="4ba", load_path=plain.saved_checkpoints[-1], eval_dataloader=loader(14))
    assert all(m._update_count == 0 for m in fresh.state.eval_metrics["eval"].values())  # nothing restored


def test_load_ignore_keys_leaves_out_what_composers_paths_name(tmp_path) -> None:
    source = MLP()
    trainer = _trainer(model=source, optimizers=torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9),
                       max_duration="3ba", save_folder=str(tmp_path), save_interval="3ba")
    trainer.fit()
    path = trainer.saved_checkpoints[-1]
    trained = {k: v.clone() for k, v in source.state_dict().items()}

    # fine-tuning: a new head keeps its own initialization
    head = MLP()
    with torch.no_grad():
        head.net[2].weight.fill_(7.0)
    _trainer(model=head, max_duration="1ba", load_path=path, load_weights_only=True,
             load_strict_model_weights=False, load_ignore_keys=["state/model/net.2.*"])
    assert torch.equal(head.net[0].weight, trained["net.0.weight"])
    assert bool((head.net[2].weight == 7.0).all())

    # a resume without the optimizer state and the RNG: the timestamp still continues
    whole = MLP()
    whole_opt = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    _trainer(model=whole, optimizers=whole_opt, max_duration="4ba", load_path=path)
    assert whole_opt.state  # what a plain resume loads
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    resumed = _trainer(model=model, optimizers=opt, max_duration="4ba", load_path=path,
                       load_ignore_keys=["state/optimizers", "rng"])
    assert resumed.state.timestamp.batch == 3 and not opt.state
    assert torch.equal(model.net[0].weight, trained["net.0.weight"])

    # a function edits the checkpoint's dict before it loads
    def zero_first_layer(tree):
        tree["state"]["model"]["net.0.bias"] = torch.zeros_like(tree["state"]["model"]["net.0.bias"])
        del tree["state"]["optimizers"]

    edited = MLP()
    opt = torch.optim.SGD(edited.parameters(), lr=0.1, momentum=0.9)
    _trainer(model=edited, optimizers=opt, max_duration="4ba", load_path=path, load_ignore_keys=zero_first_layer)
    assert not bool(edited.net[0].bias.any()) and not opt.state
    assert torch.equal(edited.net[2].weight, trained["net.2.weight"])

    message = error_of(_trainer, max_duration="1ba", load_path=path, load_ignore_keys=["state/timestamp"])
    assert message.startswith("load_ignore_keys has 'state/timestamp': lockstep checkpoints hold")


def test_save_ignore_keys_leaves_out_what_composers_globs_name(tmp_path) -> None:
    def run(folder, **kwargs):
        model = MLP()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        trainer = _trainer(model=model, optimizers=opt, max_duration="4ba", save_folder=str(folder),
                           save_interval="2ba", **kwargs)
        trainer.fit()
        return trainer, {k: v.clone() for k, v in model.state_dict().items()}

    whole, reference = run(tmp_path / "whole")
    with pytest.warns(UserWarning, match="'state/nothing/\\*' matches nothing"):
        trimmed, trained = run(tmp_path / "trimmed", save_ignore_keys=[
            "state/model/net.2.*", "rng", "state/optimizers/0/state/*/exp_avg_sq", "state/nothing/*"])
    # what is left out of the file is not taken from the live optimizer: training is the same
    assert all(torch.equal(trained[k], v) for k, v in reference.items())
    saved = torch.load(trimmed.saved_checkpoints[0], weights_only=True)
    assert "rng" not in saved and sorted(saved["state"]["model"]) == ["net.0.bias", "net.0.weight"]
    moments = saved["state"]["optimizers"][0]["state"]
    assert len(moments) == 4 and all(set(m) == {"step", "exp_avg"} for m in moments.values())
    assert saved["state"]["timestamp"]["Timestamp"]["batch"] == 2
    full = torch.load(whole.saved_checkpoints[0], weights_only=True)
    assert "rng" in full and set(full["state"]["optimizers"][0]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    # a checkpoint without its optimizer state and RNG resumes at its batch, without them
    pruned, _ = run(tmp_path / "pruned", save_ignore_keys=["state/optimizers", "rng"])
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    resumed = _trainer(model=model, optimizers=opt, max_duration="6ba", load_path=pruned.saved_checkpoints[0])
    assert resumed.state.timestamp.batch == 2 and not opt.state

    # a function edits {'state': ..., 'rng': ...} in place
    def drop_schedulers(tree):
        del tree["state"]["schedulers"]

    edited, _ = run(tmp_path / "edited", save_ignore_keys=drop_schedulers)
    assert "schedulers" not in torch.load(edited.saved_checkpoints[0], weights_only=True)["state"]
    message = error_of(_trainer, max_duration="1ba", save_ignore_keys="rng")
    assert message.startswith("save_ignore_keys='rng': give a list of paths") and "\n" not in message


class Batches(Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def batch_end(self, state, logger) -> None:
        self.seen.append(state.timestamp.batch)


class AddsAndRemoves(Callback):
    """At batch 2's end, adds a listener; at batch 4's, takes it out again."""

    def __init__(self, trainer_box: list, late: Batches) -> None:
        self.box, self.late = trainer_box, late

    def batch_end(self, state, logger) -> None:
        callbacks = self.box[0].callbacks
        if state.timestamp.batch == 2:
            callbacks.append(self.late)
        elif state.timestamp.batch == 4:
            callbacks.remove(self.late)


class StepEvents(Callback):
    """Records the events inside a step, which the Trainer skips while nothing listens to them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def batch_start(self, state, logger) -> None:
        self.seen.append(("batch_start", state.timestamp.batch))

    def before_forward(self, state, logger) -> None:
        self.seen.append(("before_forward", state.timestamp.batch))

    def after_backward(self, state, logger) -> None:
        self.seen.append(("after_backward", state.timestamp.batch))


class BeforeBackward(Algorithm):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def match(self, event, state) -> bool:
        return event is Event.BEFORE_BACKWARD

    def apply(self, event, state, logger=None) -> None:
        self.seen.append(state.timestamp.batch)


@pytest.mark.parametrize("joins", ["callback", "algorithm"])
def test_what_joins_at_the_end_of_a_step_hears_every_event_of_the_next(joins) -> None:
    box, late, recorder = [], StepEvents(), BeforeBackward()

    class Adds(Callback):  # BATCH_CHECKPOINT: the last event of the step
        def batch_checkpoint(self, state, logger) -> None:
            if state.timestamp.batch == 2:
                box[0].callbacks.append(late) if joins == "callback" else box[0].algorithms.append(recorder)

    trainer = _trainer(max_duration="4ba", callbacks=[Adds()], device_train_microbatch_size=2)
    box.append(trainer)
    trainer.fit()
    if joins == "callback":
        step = ["batch_start", "before_forward", "after_backward", "before_forward", "after_backward"]
        assert late.seen == [(name, 2) for name in step] + [(name, 3) for name in step]
    else:
        assert recorder.seen == [2, 2, 3, 3]  # two microbatches a step


def test_callbacks_added_or_removed_during_fit_take_part_from_the_next_event() -> None:
    box, late = [], Batches()
    trainer = _trainer(max_duration="6ba", callbacks=[AddsAndRemoves(box, late)])
    box.append(trainer)
    trainer.fit()
    assert late.seen == [3, 4]
    trainer.callbacks = [late]  # a plain list put in place of the Trainer's is followed too
    trainer.fit(duration="2ba")
    assert late.seen == [3, 4, 7, 8]
