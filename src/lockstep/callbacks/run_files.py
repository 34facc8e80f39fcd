"""The Trainer's default callbacks: rank-0 progress bar, per-rank log file, metrics JSONL and loss-curve PNG."""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from lockstep import dist
from lockstep.callbacks.loss_plot import draw_loss_curve
from lockstep.core.callback import Callback
from lockstep.core.eval_metrics import value_of
from lockstep.launcher.elastic_names import ELASTIC_ENV
from lockstep.time import TIMESTAMP_FIELDS, Timestamp, fraction_done
from lockstep.state import State

if TYPE_CHECKING:
    from lockstep.core.log import Logger
    from lockstep.elastic.change import RanksChanged


class ProgressBar(Callback):
    """Rank 0 only: a tqdm bar over the whole run with loss, samples/s and ETA, on ``stream``
    (``'stderr'``, ``'stdout'`` or a text stream).

    The bar is redrawn at most every 0.2 s on a terminal and every 30 s in a log file; between
    redraws a batch costs one clock read (the loss is read, a device sync, only when drawn).
    """

    def __init__(self, stream: str | IO[str] = "stderr") -> None:
        if isinstance(stream, str) and stream.lower() not in ("stdout", "stderr"):
            raise ValueError(f"{type(self).__name__}(stream={stream!r}): use 'stdout', 'stderr' or a text stream")
        self._stream = stream.lower() if isinstance(stream, str) else stream
        self._bar: Any = None
        self._start = 0.0
        self._start_samples = 0
        self._interval = 0.0
        self._next_draw = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        from tqdm import tqdm

        stream = self.stream
        self._interval = 0.2 if stream.isatty() else 30.0
        self._bar = tqdm(total=1000, file=stream, dynamic_ncols=True, leave=True, mininterval=0,
                         bar_format="{l_bar}{bar}| [{elapsed}<{remaining}{postfix}]")
        self._start, self._start_samples = time.perf_counter(), state.timestamp.sample.value
        self._next_draw = self._start + self._interval

    @property
    def stream(self) -> IO[str]:
        """Where the bar is drawn (``'stderr'`` and ``'stdout'`` are looked up when drawing starts)."""
        if isinstance(self._stream, str):
            return sys.stdout if self._stream == "stdout" else sys.stderr
        return self._stream

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._bar is not None and time.perf_counter() >= self._next_draw:
            self._draw(state)

    def _draw(self, state: State) -> None:
        now = time.perf_counter()
        self._next_draw = now + self._interval
        done = fraction_done(state.timestamp, state.max_duration, batches_per_epoch=state.batches_per_epoch)
        rate = (state.timestamp.sample.value - self._start_samples) / max(now - self._start, 1e-9)
        self._bar.set_description(f"ep {state.timestamp.epoch.value} ba {state.timestamp.batch.value}", refresh=False)
        loss = "" if state.loss is None or not state.loss.numel() else f"loss {float(state.loss):.4f}, "
        self._bar.set_postfix_str(f"{loss}{rate:.0f} samples/s", refresh=False)
        self._bar.update(int(1000 * done) - self._bar.n)

    def ranks_changed(self, state: State, logger: Logger, change: RanksChanged) -> None:
        if self._bar is None:  # this rank became rank 0: the bar goes on here
            self.fit_start(state, logger)

    def eval_end(self, state: State, logger: Logger) -> None:
        if self._bar is not None:
            self._bar.write(format_metrics(state), file=self.stream)
        elif dist.get_global_rank() == 0:
            print(format_metrics(state), file=self.stream)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._bar is not None:
            self._draw(state)
            self._bar.close()
            self._bar = None


class _Pending:
    """Per-batch records whose loss is still a tensor; turned into floats all at once (one device
    sync for the lot) when written."""

    def __init__(self) -> None:
        self._records: list[tuple[Any, torch.Tensor | None]] = []

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: Any, loss: torch.Tensor | None) -> int:
        """Keep ``record`` and its loss; returns how many are kept now."""
        self._records.append((record, loss))
        return len(self._records)

    def drain(self) -> list[tuple[Any, float]]:
        records, self._records = self._records, []
        present = [loss for _, loss in records if loss is not None]
        if not all(_is_scalar(loss) for loss in present):  # three tensor ops each: ~3 us a record
            present = [loss.detach().float().reshape(()) for loss in present]
        values = iter(torch.stack(present).tolist() if present else [])
        return [(record, next(values) if loss is not None else float("nan")) for record, loss in records]


def _is_scalar(loss: torch.Tensor) -> bool:
    """Whether ``loss`` stacks as it is: a 0-d float32 tensor outside autograd (the Trainer's)."""
    return loss.dtype is torch.float32 and loss.dim() == 0 and not loss.requires_grad


class Buffered(Callback):
    """A callback that keeps per-batch records in memory and writes them every ``flush_interval``
    batches, at least every ``flush_seconds``, and at each evaluation and at the end, so that
    logging costs a batch no system call and no device sync."""

    def __init__(self, flush_interval: int, flush_seconds: float) -> None:
        self.flush_interval = flush_interval
        self.flush_seconds = flush_seconds
        self._pending = _Pending()
        self._flushed_at = time.monotonic()

    def _add(self, record: Any, loss: torch.Tensor | None) -> None:
        kept = self._pending.add(record, loss)
        if kept >= self.flush_interval or time.monotonic() - self._flushed_at >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write what is kept now (also after a ``fit`` that raised: see Trainer.fit)."""
        self._flushed_at = time.monotonic()
        if len(self._pending):
            self._write_records(self._pending.drain())

    def _write_records(self, records: list[tuple[Any, float]]) -> None:
        raise NotImplementedError

    def close(self, state: State, logger: Logger | None = None) -> None:
        self.flush()


def evaluated(state: State) -> tuple[str, dict[str, float]]:
    """At EVAL_END: the label of the evaluator that just ran, and its metrics' values."""
    label = state.dataloader_label or "eval"
    return label, {name: value_of(m) for name, m in state.eval_metrics.get(label, {}).items()}


def eval_metric_names(label: str, results: dict[str, float]) -> dict[str, float]:
    """An evaluator's metrics under Composer's names, ``metrics/<label>/<Name>`` (lockstep's eval
    ``loss`` is not one of the model's metrics)."""
    return {f"metrics/{label}/{name}": value for name, value in results.items() if name != "loss"}


def format_metrics(state: State) -> str:
    label, results = evaluated(state)
    parts = [f"{name} {value:.4f}" for name, value in results.items()]
    return f"{label} at ep {state.timestamp.epoch.value} ba {state.timestamp.batch.value}: " + ", ".join(parts)


class RankLog(Buffered):
    """Every rank appends its own log file; ``{rank}`` in the filename keeps them apart. The
    Trainer's own record of a run (``trainer-rank{rank}.log`` in the run folder); Composer's
    :class:`~lockstep.loggers.FileLogger` is the logger destination that writes what is logged.

    A line per ``log_every_n_batches`` batches, written in bursts (see :class:`Buffered`): every
    ``flush_interval`` batches or ``flush_seconds``, whichever comes first.
    """

    def __init__(self, filename: str | Path, log_every_n_batches: int = 1, flush_interval: int = 100,
                 flush_seconds: float = 10.0) -> None:
        super().__init__(flush_interval, flush_seconds)
        self.filename = str(filename)
        self.every = log_every_n_batches
        self._file: Any = None
        self._stamp_second, self._stamp_text = -1, ""

    def init(self, state: State, logger: Logger) -> None:
        path = Path(self.filename.format(rank=dist.get_global_rank(), local_rank=dist.get_local_rank(),
                                         world_size=dist.get_world_size(), run_name=state.run_name))
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")
        self._write(f"run {state.run_name} rank {dist.get_global_rank()} of {dist.get_world_size()}")

    def _write(self, line: str, at: float | None = None) -> None:
        if self._file is not None:
            self._file.write(f"[{self._stamp(time.time() if at is None else at)}] {line}\n")

    def _stamp(self, at: float) -> str:
        """The local time of ``at`` to the second (formatted once a second: lines come in bursts)."""
        second = int(at)
        if second != self._stamp_second:
            self._stamp_second, self._stamp_text = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return self._stamp_text

    def _write_records(self, records: list[tuple[Any, float]]) -> None:
        if self._file is not None:
            self._file.writelines(f"[{self._stamp(at)}] ep {epoch} ba {batch} sp {sample} loss {loss:.6f}\n"
                                  for (at, epoch, batch, sample), loss in records)
            self._file.flush()

    def batch_end(self, state: State, logger: Logger) -> None:
        t = state.timestamp
        if self._file is not None and t.batch.value % self.every == 0:
            self._add((time.time(), t.epoch.value, t.batch.value, t.sample.value), state.loss_tensor)

    def eval_end(self, state: State, logger: Logger) -> None:
        self.flush()
        self._write(format_metrics(state))

    def ranks_changed(self, state: State, logger: Logger, change: RanksChanged) -> None:
        self.flush()
        self._write(f"{change.describe().removeprefix('lockstep: ')}; this rank is now rank {dist.get_global_rank()}")
        if self._file is not None:
            self._file.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()
        self._write("fit done")
        if self._file is not None:
            self._file.close()
            self._file = None


class MetricsJSONL(Buffered):
    """Rank 0 appends one JSON object per training batch and per evaluation to ``metrics.jsonl``,
    in bursts (see :class:`Buffered`; in an elastic job, at once), and one per change of an elastic
    job's ranks (``"kind": "ranks"``)."""

    def __init__(self, folder: str | Path, flush_interval: int = 100, flush_seconds: float = 10.0) -> None:
        super().__init__(flush_interval, flush_seconds)
        self.path = Path(folder) / "metrics.jsonl"
        self._file: Any = None

    def fit_start(self, state: State, logger: Logger) -> None:
        if os.environ.get(ELASTIC_ENV):  # rank 0 may be lost with what it kept: each record at once
            self.flush_interval = 1
        self._open()

    def _open(self) -> None:
        if self._file is None and dist.get_global_rank() == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")

    def _emit(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def _write_records(self, records: list[tuple[Any, float]]) -> None:
        heads: dict[str, str] = {}
        lines = []
        for (run_name, timestamp, lr), loss in records:
            head = heads.get(run_name) or heads.setdefault(run_name, _TRAIN_HEAD % json.dumps(run_name))
            lines.append(_TRAIN_LINE % (head, *_counts(timestamp), _json_float(lr), _json_float(loss)))
        self._file.writelines(lines)
        self._file.flush()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._file is not None:  # a Timestamp is immutable: turned into a dict when written
            self._add((state.run_name, state.timestamp, state.lr), state.loss_tensor)

    def eval_end(self, state: State, logger: Logger) -> None:
        self._open()  # an evaluation before fit (the step-0 one of the examples) is a record too
        if self._file is not None:
            self.flush()
            label, results = evaluated(state)
            self._emit({"kind": "eval", "label": label, "run_name": state.run_name, **_count_dict(state.timestamp),
                        **results, **eval_metric_names(label, results)})
            self._file.flush()

    def ranks_changed(self, state: State, logger: Logger, change: RanksChanged) -> None:
        """A record of the change; a rank that became rank 0 writes the file from here on (what
        the rank 0 that was lost had not written yet is lost with it)."""
        self._open()
        if self._file is not None:
            self.flush()
            self._emit({**change.record(), "run_name": state.run_name, **_count_dict(state.timestamp)})
            self._file.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


# A training record as json.dumps writes it, put together by hand: a line per batch, and a quarter
# of json.dumps's time (its dict had to be built first, too).
_TRAIN_HEAD = '{"kind": "train", "run_name": %s'
_TRAIN_LINE = "%s, " + ", ".join(f'"{name}": %d' for name in TIMESTAMP_FIELDS) + ', "lr": %s, "loss": %s}\n'
_times = operator.attrgetter(*TIMESTAMP_FIELDS)


def _counts(timestamp: Timestamp) -> tuple[int, ...]:
    return tuple(t.value for t in _times(timestamp))


def _count_dict(timestamp: Timestamp) -> dict[str, int]:
    return dict(zip(TIMESTAMP_FIELDS, _counts(timestamp)))
_NOT_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _json_float(value: float) -> str:
    """``value`` as json.dumps writes a float (NaN and the infinities as JavaScript names them)."""
    text = repr(float(value))
    return text if math.isfinite(value) else _NOT_FINITE[text]


class LossCurve(Callback):
    """Rank 0 draws the training loss (and the eval loss, if any) to ``loss_curve.png`` at FIT_END."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / "loss_curve.png"
        self._train: list[tuple[int, float]] = []
        self._pending = _Pending()  # losses still as tensors, read 1000 at a time
        self._eval: list[tuple[int, str, dict[str, float]]] = []
        self._rank_zero = False

    def fit_start(self, state: State, logger: Logger) -> None:
        self._rank_zero = dist.get_global_rank() == 0

    def ranks_changed(self, state: State, logger: Logger, change: RanksChanged) -> None:
        self._rank_zero = dist.get_global_rank() == 0  # a new rank 0 draws the curve from here on

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._rank_zero:
            if self._pending.add(state.timestamp.batch.value, state.loss_tensor) >= 1000:
                self._train += self._pending.drain()

    def eval_end(self, state: State, logger: Logger) -> None:
        label, results = evaluated(state)
        self._eval.append((state.timestamp.batch.value, label, results))

    def fit_end(self, state: State, logger: Logger) -> None:
        self._train += self._pending.drain()
        if dist.get_global_rank() != 0 or not self._train:
            return
        evaluations: dict[str, list[tuple[float, float]]] = {}
        for batch, label, metrics in self._eval:
            if "loss" in metrics:
                evaluations.setdefault(label, []).append((batch, metrics["loss"]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp.png")
        draw_loss_curve(tmp, f"{state.run_name}", self._train, evaluations)
        tmp.replace(self.path)
        logging.getLogger("lockstep").info("loss curve written to %s", self.path)
