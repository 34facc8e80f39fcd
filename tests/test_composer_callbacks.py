"""Composer's callbacks and loggers at Composer's paths: the stoppers end real runs at the right batch
(on every rank alike), NaNMonitor fails a run, OptimizerMonitor's norms equal norms computed by hand
(DDP and FSDP at two ranks), FileLogger writes Composer's lines, FreeOutputs frees, and the CUDA-only
callbacks say on CPU that they do nothing."""

from __future__ import annotations

import gc
import importlib
import inspect
import io
import math
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Callback, Trainer
from lockstep.callbacks import (EarlyStopper, FreeOutputs, MemorySnapshot, NaNMonitor, OOMObserver, OptimizerMonitor,
                                SystemMetricsMonitor, ThresholdStopper)
from lockstep.loggers import ConsoleLogger, FileLogger, InMemoryLogger, LoggerDestination, ProgressBarLogger
from lockstep.testing import run_distributed
from lockstep.time import Time
from tests.trainer.common import MLP, dataset, error_of, loader

pytestmark = pytest.mark.timeout(120)

BATCHES_PER_EPOCH = 7  # 28 samples, batches of 4


def fit(max_duration: str = "20ba", lr: float = 0.1, batch_size: int = 4, train=None, **kwargs) -> Trainer:
    model = kwargs.pop("model", None) or MLP()
    kwargs.setdefault("progress_bar", False)
    trainer = Trainer(model=model, train_dataloader=train or loader(batch_size), max_duration=max_duration,
                      optimizers=torch.optim.SGD(model.parameters(), lr=lr), **kwargs)
    trainer.fit()
    return trainer


class Losses(Callback):
    """This rank's loss of each batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(float(state.loss))


# -- Composer's names and signatures --------------------------------------------------------------

COMPOSER_PATHS = {
    "callbacks.early_stopper": "EarlyStopper", "callbacks.threshold_stopper": "ThresholdStopper",
    "callbacks.nan_monitor": "NaNMonitor", "callbacks.optimizer_monitor": "OptimizerMonitor",
    "callbacks.memory_snapshot": "MemorySnapshot", "callbacks.oom_observer": "OOMObserver",
    "callbacks.system_metrics_monitor": "SystemMetricsMonitor", "callbacks.free_outputs": "FreeOutputs",
    "loggers.file_logger": "FileLogger", "loggers.console_logger": "ConsoleLogger",
    "loggers.progress_bar_logger": "ProgressBarLogger",
}

# Composer 0.32.1's constructor parameters and defaults
COMPOSER_SIGNATURES = {
    EarlyStopper: "(monitor, dataloader_label, comp=None, min_delta=0.0, patience=1)",
    ThresholdStopper: "(monitor, dataloader_label, threshold, *, comp=None, stop_on_batch=False)",
    NaNMonitor: "()",
    FreeOutputs: "()",
    OptimizerMonitor: "(log_optimizer_metrics=True, batch_log_interval=10)",
    SystemMetricsMonitor: "(log_all_data=False)",
    MemorySnapshot: "(skip_batches=1, interval='3ba', max_entries=100000, folder='{run_name}/torch_traces', "
                    "filename='rank{rank}.{batch}.memory_snapshot', "
                    "remote_file_name='{run_name}/torch_memory_traces', overwrite=False)",
    OOMObserver: "(max_entries=100000, folder='{run_name}/torch_traces', filename='rank{rank}_oom', "
                 "remote_file_name='{run_name}/oom_traces/rank{rank}_oom', overwrite=False)",
    FileLogger: "(filename='{run_name}/logs-rank{rank}.txt', remote_file_name=None, *, capture_stdout=True, "
                "capture_stderr=True, buffer_size=1, log_traces=True, flush_interval=100, overwrite=False)",
    ConsoleLogger: "(log_interval='1ba', stream='stderr', log_traces=False)",
    ProgressBarLogger: "(stream='stderr', log_traces=False)",
}


@pytest.mark.parametrize("path, name", COMPOSER_PATHS.items())
def test_each_class_is_at_composers_path(path: str, name: str) -> None:
    module = importlib.import_module(f"lockstep.{path}")
    package = importlib.import_module(f"lockstep.{path.split('.')[0]}")
    assert getattr(module, name) is getattr(package, name)


@pytest.mark.parametrize("cls", COMPOSER_SIGNATURES, ids=lambda c: c.__name__)
def test_constructors_take_composers_arguments(cls: type) -> None:
    params = [p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(cls).parameters.values()]
    assert str(inspect.Signature(params)) == COMPOSER_SIGNATURES[cls]


# -- stopping ---------------------------------------------------------------------------------------

def test_stop_training_ends_the_run_after_the_current_batch() -> None:
    class StopAt(Callback):
        def batch_end(self, state, logger) -> None:
            if state.timestamp.batch == 3:
                state.stop_training()

    trainer = fit("5ep", callbacks=[StopAt()])
    assert trainer.state.timestamp.batch == 3 and trainer.state.max_duration == Time(3, "ba")


def test_early_stopper_stops_patience_after_the_best_eval_value() -> None:
    # lr=0: the eval loss never improves on the first one, at batch 1; more than 2 batches later is batch 4
    trainer = fit(lr=0.0, eval_dataloader=loader(14), eval_interval="1ba",
                  callbacks=[EarlyStopper("loss", "eval", patience="2ba")])
    assert trainer.state.timestamp.batch == 4


def test_early_stopper_patience_as_an_int_counts_epochs() -> None:
    stopper = EarlyStopper("accuracy", "eval", patience=1)  # higher is better: 'accuracy' names no loss
    trainer = fit("10ep", lr=0.0, eval_dataloader=loader(14), callbacks=[stopper])
    assert trainer.state.timestamp.epoch == 3 and trainer.state.timestamp.batch == 3 * BATCHES_PER_EPOCH
    assert stopper.comp_func is torch.greater and stopper.best_occurred.epoch == 1


def test_early_stopper_on_the_training_loss_needs_min_delta_of_improvement() -> None:
    # no batch improves the loss by 100: the best stays at batch 1, and batch 5 is 4 > 3 batches on
    trainer = fit(callbacks=[EarlyStopper("loss", "train", min_delta=100.0, patience="3ba")])
    assert trainer.state.timestamp.batch == 5


def test_early_stopper_keeps_training_while_it_improves() -> None:
    reference = Losses()
    fit("12ba", lr=0.5, callbacks=[reference])
    expected, best, best_batch = 12, math.inf, 0
    for batch, loss in enumerate(reference.losses, start=1):
        if loss < best:
            best, best_batch = loss, batch
        if batch - best_batch > 1:
            expected = batch
            break
    assert expected > 2  # it improved at first
    trainer = fit("12ba", lr=0.5, callbacks=[EarlyStopper("loss", "train", patience="1ba")])
    assert trainer.state.timestamp.batch == expected


def test_threshold_stopper_on_eval_stops_at_the_first_evaluation_past_it() -> None:
    trainer = fit(eval_dataloader=loader(14), eval_interval="3ba",
                  callbacks=[ThresholdStopper("loss", "eval", threshold=math.inf)])
    assert trainer.state.timestamp.batch == 3
    trainer = fit(eval_dataloader=loader(14), eval_interval="3ba",
                  callbacks=[ThresholdStopper("accuracy", "eval", threshold=2.0, comp="lt")])
    assert trainer.state.timestamp.batch == 3


def test_threshold_stopper_on_the_training_loss_stops_at_epoch_end_or_at_the_batch() -> None:
    assert fit(callbacks=[ThresholdStopper("loss", "train", math.inf)]).state.timestamp.batch == BATCHES_PER_EPOCH
    reference = Losses()
    fit("10ba", callbacks=[reference])
    threshold, expected = _crossing(reference.losses)
    stopper = ThresholdStopper("loss", "train", threshold, stop_on_batch=True)
    assert fit(callbacks=[stopper]).state.timestamp.batch == expected


def _crossing(losses: list[float]) -> tuple[float, int]:
    """A threshold the loss first falls below at a batch after the first, by a wide margin; that batch."""
    gaps = [(min(losses[:k]) - losses[k], k) for k in range(1, len(losses) - 1) if losses[k] < min(losses[:k])]
    gap, k = max(gaps)
    assert gap > 1e-3
    return losses[k] + gap / 2, k + 1


def test_the_stoppers_say_what_to_watch() -> None:
    message = error_of(fit, callbacks=[EarlyStopper("Accuracy", "eval")], eval_dataloader=loader(14))
    assert message.startswith("EarlyStopper: no metric 'Accuracy' for dataloader_label 'eval' (there: accuracy, loss)")
    message = error_of(fit, callbacks=[ThresholdStopper("precision", "train", 0.5)])  # not a training metric
    assert message.startswith("ThresholdStopper: dataloader_label 'train' watches the training loss: "
                              "set monitor='loss'")
    assert error_of(fit, callbacks=[ThresholdStopper("accuracy", "train", 0.5)],  # a training metric
                    model=MLP(train_accuracy=True)) == "no error"
    assert "use 'gt', 'greater', 'lt', 'less'" in error_of(EarlyStopper, "loss", "eval", comp="bigger")
    assert "epochs or batches" in error_of(EarlyStopper, "loss", "eval", patience="10sp")


def test_composers_nested_eval_metrics_are_read_by_label() -> None:
    state = SimpleNamespace(eval_metrics={"my_evaluator": {"MulticlassAccuracy": 0.9}}, timestamp=None,
                            dataloader_label="my_evaluator", stop_training=lambda: setattr(state, "stopped", True))
    ThresholdStopper("MulticlassAccuracy", "my_evaluator", 0.8).eval_end(state, None)
    assert state.stopped


def _stop_on_the_mean_loss(threshold: float) -> tuple[int, list[float]]:
    losses = Losses()
    trainer = fit(batch_size=4, callbacks=[losses, ThresholdStopper("loss", "train", threshold, stop_on_batch=True)])
    return trainer.state.timestamp.batch, losses.losses


@pytest.mark.timeout(120)
def test_every_rank_stops_at_the_batch_where_the_mean_loss_crosses() -> None:
    # DDP over two ranks of 4 follows the path of one process over batches of 8
    reference = Losses()
    fit("10ba", batch_size=8, callbacks=[reference])
    threshold, expected = _crossing(reference.losses)
    (batch0, losses0), (batch1, losses1) = run_distributed(_stop_on_the_mean_loss, world_size=2, args=(threshold,),
                                                           timeout=100)
    assert batch0 == batch1 == expected
    assert [(a + b) / 2 for a, b in zip(losses0, losses1)] == pytest.approx(reference.losses[:expected], abs=1e-5)


# -- NaNMonitor -------------------------------------------------------------------------------------

def test_nan_monitor_fails_the_run_at_the_first_nan_loss() -> None:
    x, y = dataset().tensors
    x = x.clone()
    x[9] = float("nan")  # in the third batch of 4
    losses = Losses()
    with pytest.raises(RuntimeError, match=r"^Train loss contains a NaN\.$"):
        fit(train=DataLoader(TensorDataset(x, y), batch_size=4), callbacks=[losses, NaNMonitor()])
    assert len(losses.losses) == 2
    state = SimpleNamespace(loss={"ce": torch.tensor(1.0), "aux": torch.tensor([0.0, math.nan])})
    assert error_of(NaNMonitor().after_loss, state, None) == "Train loss aux contains a NaN."
    assert error_of(NaNMonitor().after_loss, SimpleNamespace(loss=torch.tensor(math.inf)), None) == "no error"


# -- OptimizerMonitor -------------------------------------------------------------------------------

def _reference_norms(batches: int, batch_size: int = 8, lr: float = 0.1) -> list[dict[str, float]]:
    """Each batch's gradient norms, computed by hand in one process over the global batches."""
    model = MLP()
    x, y = dataset().tensors
    norms = []
    for b in range(batches):
        model.zero_grad()
        rows = slice(b * batch_size, (b + 1) * batch_size)
        torch.nn.functional.cross_entropy(model((x[rows],)), y[rows]).backward()
        grads = {f"l2_norm/grad/{n}": p.grad.norm().item() for n, p in model.named_parameters()}
        grads["l2_norm/grad/global"] = math.sqrt(sum(v ** 2 for v in grads.values()))
        norms.append(grads)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return norms


def _logged_norms(memory: InMemoryLogger) -> list[dict[str, float]]:
    data = {k: v for k, v in memory.data.items() if k.startswith("l2_norm/")}
    batches = sorted({t.batch for series in data.values() for t, _ in series})
    return [{k: v for k, series in data.items() for t, v in series if t.batch == b} for b in batches]


def test_optimizer_monitor_logs_every_interval_the_norms_computed_by_hand() -> None:
    memory = InMemoryLogger()
    fit("4ba", batch_size=8, loggers=[memory], callbacks=[OptimizerMonitor(batch_log_interval=2)])
    assert [t.batch for t, _ in memory.data["l2_norm/grad/global"]] == [2, 4]
    reference = _reference_norms(4)
    logged = _logged_norms(memory)
    assert logged[0].keys() == reference[1].keys() == {"l2_norm/grad/global", "l2_norm/grad/net.0.weight",
                                                       "l2_norm/grad/net.0.bias", "l2_norm/grad/net.2.weight",
                                                       "l2_norm/grad/net.2.bias"}
    for got, want in zip(logged, [reference[1], reference[3]]):
        assert got == pytest.approx(want, rel=1e-5)


def test_optimizer_monitor_logs_what_the_optimizer_reports() -> None:
    class Reporting(torch.optim.SGD):
        def report_per_parameter_metrics(self, param, name, metrics):
            return {**metrics, f"l2_norm/param/{name}": torch.linalg.vector_norm(param.data)}

    model, memory = MLP(), InMemoryLogger()
    trainer = Trainer(model=model, train_dataloader=loader(4), max_duration="1ba", progress_bar=False,
                      optimizers=Reporting(model.parameters(), lr=0.1), loggers=[memory],
                      callbacks=[OptimizerMonitor(batch_log_interval=1)])
    trainer.fit()
    # read after the step, as Composer reads it at BATCH_END
    assert memory.most_recent_values["l2_norm/param/net.0.weight"] == pytest.approx(model.net[0].weight.norm().item())


def _norms_at_two_ranks() -> list[list[dict[str, float]]]:
    results = []
    for fsdp_config in (None, {"sharding_strategy": "FULL_SHARD"}):
        memory = InMemoryLogger()
        memory.rank_zero_only = False  # every rank's view: each must hold the global norms
        fit("2ba", batch_size=4, loggers=[memory], fsdp_config=fsdp_config,
            callbacks=[OptimizerMonitor(batch_log_interval=1)])
        results.append(_logged_norms(memory))
    return results


@pytest.mark.timeout(120)
def test_optimizer_monitor_logs_global_norms_under_ddp_and_fsdp() -> None:
    reference = _reference_norms(2)
    for rank_results in run_distributed(_norms_at_two_ranks, world_size=2, timeout=100):
        ddp, fsdp = rank_results
        for logged in (ddp, fsdp):
            assert len(logged) == 2
            for got, want in zip(logged, reference):
                assert got == pytest.approx(want, rel=1e-5)


# -- FreeOutputs ------------------------------------------------------------------------------------

class OutputsWatch(Callback):
    """Whether the model's outputs of each microbatch are still alive when the backward starts."""

    def __init__(self) -> None:
        self.alive: list[bool] = []
        self.outputs: list[object] = []

    def after_forward(self, state, logger) -> None:
        self._ref = weakref.ref(state.outputs)

    def before_backward(self, state, logger) -> None:
        gc.collect()
        self.alive.append(self._ref() is not None)
        self.outputs.append(state.outputs)


def test_free_outputs_drops_the_outputs_after_the_loss() -> None:
    kept, freed = OutputsWatch(), OutputsWatch()
    fit("2ba", callbacks=[kept], grad_accum=2)
    fit("2ba", callbacks=[freed, FreeOutputs()], grad_accum=2)
    assert kept.alive == [True] * 4
    assert freed.alive == [False] * 4
    assert all(isinstance(o, torch.Tensor) and o.numel() == 0 for o in freed.outputs)


# -- CUDA-only callbacks ----------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [MemorySnapshot, OOMObserver], ids=lambda c: c.__name__)
def test_cuda_only_callbacks_warn_on_cpu_and_do_nothing(cls: type, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=rf"^{cls.__name__} does nothing without a GPU \(the model is on cpu\)"):
        trainer = fit("3ba", callbacks=[cls(skip_batches=0) if cls is MemorySnapshot else cls()], run_name="cpu")
    assert trainer.state.timestamp.batch == 3 and list(tmp_path.iterdir()) == []


# -- SystemMetricsMonitor ---------------------------------------------------------------------------

def test_system_metrics_monitor_logs_composers_names_per_batch() -> None:
    memory = InMemoryLogger()
    fit("3ba", loggers=[memory], eval_dataloader=loader(14), eval_interval="3ba", callbacks=[SystemMetricsMonitor()])
    data = memory.data
    for name in ("cpu_percentage", "cpu_memory_total", "cpu_memory_available", "cpu_memory_percent",
                 "disk_memory_total", "disk_memory_used", "disk_memory_free", "network_bytes_sent",
                 "network_bytes_recv"):
        assert len(data[name]) == 3 + 2, name  # 3 training and 2 evaluation batches
    assert data["cpu_memory_total"][0][1] > 0 and 0 <= data["cpu_percentage"][-1][1] <= 100


# -- loggers ----------------------------------------------------------------------------------------

class Printer(Callback):
    def batch_end(self, state, logger) -> None:
        print(f"hello from batch {state.timestamp.batch.value}")


class FileSeen(Callback):
    """What the file holds at the start of each batch (after the previous batch's flush)."""

    def __init__(self, sink: FileLogger) -> None:
        self.sink, self.seen = sink, {}

    def batch_start(self, state, logger) -> None:
        self.seen[state.timestamp.batch] = Path(self.sink.filename).read_text()


def test_file_logger_writes_composers_lines(tmp_path: Path) -> None:
    sink, memory = FileLogger(str(tmp_path / "{run_name}" / "logs-rank{rank}.txt"), flush_interval=2), InMemoryLogger()
    assert "pass it to Trainer(loggers=[...]) first" in error_of(lambda: sink.filename)
    seen = FileSeen(sink)
    trainer = fit("3ba", loggers=[sink, memory], callbacks=[Printer(), seen], run_name="filetest")
    trainer.logger.log_traces({"algorithm_traces/Clip/after_train_batch": 1})
    trainer.close()
    print("after close")
    assert sink.filename == str(tmp_path / "filetest" / "logs-rank0.txt")
    lines = (tmp_path / "filetest" / "logs-rank0.txt").read_text().splitlines()
    for batch, (_, loss) in enumerate(memory.data["loss/train/total"], start=1):
        assert f"[metric][batch={batch}]: loss/train/total: {loss:.4f} " in lines
        assert f"[metric][batch={batch}]: time/batch: {batch} " in lines
        assert f"[stdout]: hello from batch {batch}" in lines
    assert '[hyperparameter]: run_name: "filetest" ' in lines
    assert "[trace]: algorithm_traces/Clip/after_train_batch:1" in lines
    assert not any("after close" in line for line in lines) and "write" not in vars(sys.stdout)
    # flushed every 2 batches: batch 2's lines are in the file when batch 3 starts
    assert "[metric][batch=2]: time/batch: 2 " in seen.seen[2].splitlines()


_FAILING_SCRIPT = """
import sys
from lockstep import Callback, Trainer
from lockstep.loggers import FileLogger
from tests.trainer.common import MLP, loader, sgd

class Boom(Callback):
    def fit_start(self, state, logger):
        raise RuntimeError("boom at fit start")

model = MLP()
Trainer(model=model, train_dataloader=loader(8), max_duration="1ep", optimizers=sgd(model), callbacks=[Boom()],
        loggers=[FileLogger(sys.argv[1], capture_stderr=True)], progress_bar=False).fit()
"""


@pytest.mark.timeout(120)
def test_a_script_that_dies_of_an_error_leaves_its_traceback_in_the_file_logger(tmp_path: Path) -> None:
    import os
    import subprocess

    script, log = tmp_path / "fails.py", tmp_path / "log.txt"
    script.write_text(_FAILING_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(script), str(log)], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, timeout=100)
    assert done.returncode == 1 and "RuntimeError: boom at fit start" in done.stderr
    lines = log.read_text().splitlines()  # closed at exit, after the traceback (as Composer's)
    assert lines[-1] == "[stderr]: RuntimeError: boom at fit start"
    assert "[stderr]: Traceback (most recent call last):" in lines


def test_file_logger_appends_unless_told_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    path.write_text("earlier run\n")
    fit("1ba", loggers=[FileLogger(str(path), capture_stdout=False, capture_stderr=False)]).close()
    assert path.read_text().startswith("earlier run\n[hyperparameter]: ")
    fit("1ba", loggers=[FileLogger(str(path), overwrite=True, capture_stdout=False, capture_stderr=False)]).close()
    assert path.read_text().startswith("[hyperparameter]: ")


@pytest.mark.timeout(120)
def test_file_logger_writes_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_write_rank_logs, world_size=2, args=(str(tmp_path),), timeout=100)
    for rank in range(2):
        text = (tmp_path / "ranks" / f"logs-rank{rank}.txt").read_text()
        assert f"[metric][batch=2]: loss/train/total: {results[rank]:.4f} " in text
        assert "[metric][batch=1]: cpu_percentage: " in text  # gathered at every batch start by all ranks


def _write_rank_logs(folder: str) -> float:
    losses = Losses()
    trainer = fit("2ba", run_name="ranks", callbacks=[losses, SystemMetricsMonitor()],
                  loggers=[FileLogger(folder + "/{run_name}/logs-rank{rank}.txt", capture_stderr=False)])
    trainer.close()
    return losses.losses[-1]


class Uploads(LoggerDestination):
    def __init__(self) -> None:
        self.uploads: list[tuple[str, Path, bool]] = []

    def upload_file(self, state, remote_file_name, file_path, *, overwrite) -> None:
        self.uploads.append((remote_file_name, file_path, overwrite))


def test_file_logger_hands_its_file_to_the_uploaders_at_each_flush(tmp_path: Path) -> None:
    uploads = Uploads()
    sink = FileLogger(str(tmp_path / "{run_name}.txt"), remote_file_name="logs/{run_name}-rank{rank}.txt",
                      capture_stdout=False, capture_stderr=False, flush_interval=2)
    fit("4ba", loggers=[sink, uploads], run_name="up").close()
    # at epoch start, batches 2 and 4, the end of fit, and close
    assert uploads.uploads == [("logs/up-rank0.txt", tmp_path / "up.txt", True)] * 5


def test_progress_bar_logger_replaces_the_default_bar() -> None:
    stream = io.StringIO()
    bar = ProgressBarLogger(stream=stream, log_traces=True)
    trainer = fit("3ba", loggers=[bar], progress_bar=True)
    assert [c for c in trainer.callbacks if type(c).__name__ in ("ProgressBar", "ProgressBarLogger")] == [bar]
    trainer.logger.log_traces({"algorithm_traces/Clip/after_train_batch": 0})
    assert "100%" in stream.getvalue() and "[trace]: algorithm_traces/Clip/after_train_batch:0" in stream.getvalue()


def test_console_logger_takes_composers_stream_and_traces() -> None:
    stream = io.StringIO()
    ConsoleLogger(stream=stream, log_traces=True).log_traces({"algorithm_traces/A/init": 1})
    assert stream.getvalue() == "[trace]: algorithm_traces/A/init:1\n"
    message = error_of(ConsoleLogger, stream="stdot")
    assert message == "ConsoleLogger(stream='stdot'): use 'stdout', 'stderr' or a text stream"


def test_a_memory_plot_that_fails_to_render_leaves_no_file_and_the_others_are_written(tmp_path: Path) -> None:
    from lockstep.callbacks._cuda_traces import write_snapshot

    def offline(snapshot):  # as torch's flame graphs do on a node that cannot reach GitHub
        raise OSError("Temporary failure in name resolution")

    files = {str(tmp_path / "a.pickle"): None, str(tmp_path / "b.svg"): offline,
             str(tmp_path / "c.html"): lambda snapshot: f"<p>{len(snapshot['segments'])}</p>"}
    written = write_snapshot({"segments": [1, 2]}, files)
    assert written == [str(tmp_path / "a.pickle"), str(tmp_path / "c.html")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pickle", "c.html"]
    assert (tmp_path / "c.html").read_text() == "<p>2</p>"


def test_activation_monitor_logs_each_modules_statistics_on_its_interval() -> None:
    from lockstep.callbacks import ActivationMonitor

    seen: dict[str, torch.Tensor] = {}
    model = MLP()
    first = model.net[0]
    first.register_forward_hook(lambda m, i, o: seen.setdefault(f"b{len(seen)}", o.detach().clone()))
    memory = InMemoryLogger()
    monitor = ActivationMonitor(interval="10ba", only_log_wandb=True)  # no W&B destination: every destination
    trainer = Trainer(model=model, train_dataloader=loader(2), max_duration="12ba", progress_bar=False,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1), loggers=memory, callbacks=monitor)
    trainer.fit()
    steps = [int(t.batch) for t, _ in memory.data["activations/max/net.0_output.0"]]
    assert steps == [0, 10]  # batches 0 and 10, once each
    output = seen["b0"]  # net.0's output on batch 0
    logged = memory.data["activations/max/net.0_output.0"][0][1]
    assert logged == pytest.approx(float(output.max(dim=-1).values.mean()))
    l2 = memory.data["activations/l2_norm/net.0_output.0"][0][1]
    assert l2 == pytest.approx(float(output.norm(dim=-1).mean()))
    assert "activations/average/MLP_input.0.0" in memory.data  # the root, named by its class; a tuple input: each tensor
    assert not monitor.handles  # hooks only for the forward that logs
