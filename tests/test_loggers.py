"""Loggers and monitors: Composer's metric names reach every destination; TensorBoard, MLflow and
W&B (offline) are read back from what they wrote; a failing logger warns once and training goes on."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lockstep import Callback, Trainer, dist
from lockstep.callbacks import LRMonitor, MemoryMonitor, RuntimeEstimator, SpeedMonitor
from lockstep.loggers import InMemoryLogger, LoggerDestination, MLFlowLogger, TensorboardLogger, WandBLogger
from lockstep.optim import LinearScheduler
from lockstep.testing import run_distributed
from tests.trainer.common import MLP, error_of, loader

BATCHES = 10  # 28 samples, batch 4: 7 batches an epoch


class TokenMLP(MLP):
    """Counts 5 tokens per sample and 1000 FLOPs per sample."""

    def num_tokens(self, batch):
        return 5 * len(batch[0])

    def flops_per_batch(self, batch):
        return 1000 * len(batch[0])


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(float(state.loss))


def train(loggers, callbacks=(), run_folder=None, **kw) -> Trainer:
    model = TokenMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = Trainer(model=model, train_dataloader=loader(4), eval_dataloader=loader(4), max_duration=f"{BATCHES}ba",
                      eval_interval="5ba", optimizers=opt, schedulers=LinearScheduler(alpha_f=0.0),
                      loggers=loggers, callbacks=list(callbacks), progress_bar=False, run_folder=run_folder, **kw)
    trainer.fit()
    return trainer


def test_composer_names_reach_the_logger_every_batch() -> None:
    memory, losses = InMemoryLogger(), Losses()
    train([memory], [losses, SpeedMonitor(window_size=4, gpu_flops_available=1e9), LRMonitor(), MemoryMonitor(),
                     RuntimeEstimator()])
    data = memory.data
    assert [t.batch for t, _ in data["loss/train/total"]] == list(range(1, BATCHES + 1))
    assert [v for _, v in data["loss/train/total"]] == pytest.approx(losses.losses, rel=1e-6)
    assert [v for _, v in data["lr-SGD/group0"]] == pytest.approx([0.5 * (1 - b / BATCHES) for b in range(1, 11)])
    assert [v for _, v in data["time/batch"]] == list(range(1, BATCHES + 1))
    assert data["time/epoch"][-1][1] == 1
    assert len(data["metrics/eval/accuracy"]) == 2 and 0 <= memory.most_recent_values["metrics/eval/accuracy"] <= 1
    speed = memory.most_recent_values
    # samples, tokens and FLOPs move together: 5 tokens and 1000 FLOPs per sample
    assert speed["throughput/samples_per_sec"] > 0
    assert speed["throughput/tokens_per_sec"] == pytest.approx(5 * speed["throughput/samples_per_sec"])
    assert speed["throughput/flops_per_sec"] == pytest.approx(1000 * speed["throughput/samples_per_sec"])
    assert speed["throughput/device/mfu"] == pytest.approx(speed["throughput/flops_per_sec"] / 1e9)
    assert 0.01 < speed["memory/rss_mem"] <= speed["memory/peak_rss_mem"] < 64
    assert len(data["wall_clock/remaining_estimate"]) == BATCHES - 1 and speed["wall_clock/remaining_estimate"] == 0
    assert memory.hyperparameters["max_duration"] == f"{BATCHES}ba" and memory.hyperparameters["world_size"] == 1


def test_a_failing_logger_warns_once_and_training_goes_on() -> None:
    class Broken(LoggerDestination):
        def log_metrics(self, metrics, step=None):
            raise OSError("disk gone")

    memory = InMemoryLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train([Broken(), memory])
    failures = [w for w in caught if "Broken failed" in str(w.message)]
    assert len(failures) == 1 and "disk gone" in str(failures[0].message)
    assert trainer.state.timestamp.batch == BATCHES and len(memory.data["loss/train/total"]) == BATCHES
    assert "loggers[0] is a LRMonitor, not a destination from lockstep.loggers" in error_of(train, [LRMonitor()])


def test_a_missing_extra_is_named(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert error_of(TensorboardLogger) == ("TensorboardLogger needs the 'tensorboard' package: "
                                           "pip install 'torch-lockstep[tensorboard]'")


def test_tensorboard_event_files_hold_every_batch(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = train([TensorboardLogger()], [LRMonitor()], run_folder=str(tmp_path))
    trainer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = events.Scalars("loss/train/total")
    assert [e.step for e in loss] == list(range(1, BATCHES + 1))
    assert [e.value for e in events.Scalars("lr-SGD/group0")] == pytest.approx(
        [0.5 * (1 - b / BATCHES) for b in range(1, 11)])
    assert [e.step for e in events.Scalars("metrics/eval/accuracy")] == [5, 10]


def test_mlflow_sqlite_store_holds_metrics_and_parameters(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="exp", tracking_uri=uri)
    train([logger], run_name="mlflow-run").close()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(logger.run_id)
    assert run.info.run_name == "mlflow-run" and run.info.status == "FINISHED"
    assert run.data.params["max_duration"] == f"{BATCHES}ba"
    history = client.get_metric_history(logger.run_id, "loss/train/total")
    assert sorted(m.step for m in history) == list(range(1, BATCHES + 1))
    assert len(client.get_metric_history(logger.run_id, "metrics/eval/accuracy")) == 2


def wandb_records(path: Path):
    """The records of an offline W&B run file: a 7-byte file header, then LevelDB-style log blocks
    of 32 KiB whose chunks (7-byte header: crc, length, type) hold protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        parts = [payload] if kind in (1, 2) else [*parts, payload]  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_is_written_without_a_network(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    train([WandBLogger(project="lockstep-test", mode="offline")], run_folder=str(tmp_path), run_name="wb")
    # run.finish() only tells wandb's service that the run is done; the service closes (flushes) the
    # run's file afterwards, on its own time. Its teardown waits for that.
    wandb.teardown()
    files = list((tmp_path / "wandb").glob("offline-run-*/*.wandb"))
    assert len(files) == 1
    history, config = [], {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "config":
            config.update({_key(item): json.loads(item.value_json) for item in record.config.update})
    assert [h["time/batch"] for h in history] == list(range(1, BATCHES + 1))
    assert [h["_step"] for h in history] == list(range(1, BATCHES + 1))
    assert sum("metrics/eval/accuracy" in h for h in history) == 2
    assert config["run_name"] == "wb" and config["max_duration"] == f"{BATCHES}ba"


def _two_ranks() -> dict[str, int]:
    everyone, rank_zero = InMemoryLogger(), InMemoryLogger()  # as Composer's, it logs on every rank
    rank_zero.rank_zero_only = True
    model = MLP()
    Trainer(model=model, train_dataloader=loader(2), max_duration="3ba", progress_bar=False,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1), loggers=[everyone, rank_zero]).fit()
    return {"everyone": len(everyone.data.get("loss/train/total", [])),
            "rank_zero": len(rank_zero.data.get("loss/train/total", [])), "rank": dist.get_global_rank()}


@pytest.mark.timeout(120)
def test_loggers_write_on_rank_zero_unless_asked() -> None:
    assert InMemoryLogger.rank_zero_only is False  # Composer's InMemoryLogger keeps every rank's values
    results = run_distributed(_two_ranks, world_size=2, timeout=100)
    assert results == [{"everyone": 3, "rank_zero": 3, "rank": 0}, {"everyone": 3, "rank_zero": 0, "rank": 1}]


def test_metrics_jsonl_lines_are_what_json_dumps_writes(tmp_path: Path) -> None:
    """The per-batch line is put together by hand, for speed: it must be json.dumps's, byte for
    byte, for any run name and for the floats JSON has no numbers for; losses that are not 0-d
    float32 tensors (bf16, a graph attached, one element of shape [1]) are read too."""
    from lockstep.callbacks.run_files import MetricsJSONL
    from lockstep.time import TIMESTAMP_FIELDS, Timestamp

    sink = MetricsJSONL(tmp_path)
    sink._file = open(tmp_path / "metrics.jsonl", "w")
    stamp = Timestamp(epoch=1, batch=12, sample=96, token=7, batch_in_epoch=2, sample_in_epoch=16, token_in_epoch=1)
    losses = [torch.tensor(0.1) + 0.2, torch.tensor(float("nan")), torch.tensor(float("inf")),
              torch.tensor(-float("inf")), torch.tensor(1.5, dtype=torch.bfloat16),
              torch.tensor(2.0, requires_grad=True) * 1, torch.tensor([3.25])]
    lrs = [1e-3, 1e-20, float("nan"), 3.0, 0.0, float("inf"), 5e-324]
    names = ['run "quoted" \\ é', "plain", "x\ny"]
    for i, (loss, lr) in enumerate(zip(losses, lrs)):
        sink._add((names[i % len(names)], stamp, lr), loss)
    sink.flush()
    sink._file.close()
    counts = {name: stamp.state_dict()[name] for name in TIMESTAMP_FIELDS}  # the counts, not the clocks
    expected = [json.dumps({"kind": "train", "run_name": names[i % len(names)], **counts, "lr": lr,
                            "loss": loss.detach().float().item()})
                for i, (loss, lr) in enumerate(zip(losses, lrs))]
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == expected


def test_rank_log_stamps_each_line_with_its_own_second(tmp_path: Path) -> None:
    import time

    from lockstep.callbacks.run_files import RankLog

    sink = RankLog(tmp_path / "log.txt")
    sink._file = open(tmp_path / "log.txt", "w")
    moments = [1_700_000_000.2, 1_700_000_000.9, 1_700_000_001.0, 1_700_003_600.5]
    sink._write_records([((at, 0, i, 4 * i), 0.5) for i, at in enumerate(moments)])
    sink._file.close()
    stamps = [line[1:20] for line in (tmp_path / "log.txt").read_text().splitlines()]
    assert stamps == [time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) for at in moments]
