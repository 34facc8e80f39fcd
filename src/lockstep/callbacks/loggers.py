"""Built-in callbacks: rank-0 progress bar, per-rank log file, metrics JSONL and loss-curve PNG."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from lockstep import dist
from lockstep.callbacks import Callback
from lockstep.time import fraction_done
from lockstep.state import State


class ProgressBar(Callback):
    """Rank 0 only: a tqdm bar over the whole run with loss, samples/s and ETA."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._start = 0.0
        self._start_samples = 0

    def fit_start(self, state: State) -> None:
        if dist.get_global_rank() != 0:
            return
        from tqdm import tqdm

        # On a terminal redraw often; in a log file, a line every 30 s is plenty.
        interval = 0.2 if sys.stderr.isatty() else 30.0
        self._bar = tqdm(total=1000, file=sys.stderr, dynamic_ncols=True, leave=True, mininterval=interval,
                         bar_format="{l_bar}{bar}| [{elapsed}<{remaining}{postfix}]")
        self._start, self._start_samples = time.perf_counter(), state.timestamp.sample

    def batch_end(self, state: State) -> None:
        if self._bar is None:
            return
        done = fraction_done(state.timestamp, state.max_duration, batches_per_epoch=state.batches_per_epoch)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        rate = (state.timestamp.sample - self._start_samples) / elapsed
        self._bar.set_description(f"ep {state.timestamp.epoch} ba {state.timestamp.batch}", refresh=False)
        self._bar.set_postfix_str(f"loss {state.loss:.4f}, {rate:.0f} samples/s", refresh=False)
        self._bar.update(int(1000 * done) - self._bar.n)  # redraws at most every mininterval

    def eval_end(self, state: State) -> None:
        if self._bar is not None:
            self._bar.write(format_metrics(state), file=sys.stderr)
        elif dist.get_global_rank() == 0:
            print(format_metrics(state), file=sys.stderr)

    def fit_end(self, state: State) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_metrics(state: State) -> str:
    parts = [f"{name} {value:.4f}" for name, value in state.eval_metrics.items()]
    return f"eval at ep {state.timestamp.epoch} ba {state.timestamp.batch}: " + ", ".join(parts)


class FileLogger(Callback):
    """Every rank appends its own log file; ``{rank}`` in the filename keeps them apart."""

    def __init__(self, filename: str | Path, log_every_n_batches: int = 1) -> None:
        self.filename = str(filename)
        self.every = log_every_n_batches
        self._file: Any = None

    def init(self, state: State) -> None:
        path = Path(self.filename.format(rank=dist.get_global_rank(), local_rank=dist.get_local_rank(),
                                         world_size=dist.get_world_size(), run_name=state.run_name))
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)
        self._write(f"run {state.run_name} rank {dist.get_global_rank()} of {dist.get_world_size()}")

    def _write(self, line: str) -> None:
        if self._file is not None:
            self._file.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")

    def batch_end(self, state: State) -> None:
        if state.timestamp.batch % self.every == 0:
            t = state.timestamp
            self._write(f"ep {t.epoch} ba {t.batch} sp {t.sample} loss {state.loss:.6f}")

    def eval_end(self, state: State) -> None:
        self._write(format_metrics(state))

    def fit_end(self, state: State) -> None:
        self._write("fit done")
        if self._file is not None:
            self._file.close()
            self._file = None


class MetricsJSONL(Callback):
    """Rank 0 appends one JSON object per training batch and per evaluation to ``metrics.jsonl``."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / "metrics.jsonl"
        self._file: Any = None

    def fit_start(self, state: State) -> None:
        if dist.get_global_rank() == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    def _emit(self, state: State, kind: str, values: dict[str, float]) -> None:
        if self._file is not None:
            record = {"kind": kind, "run_name": state.run_name, **state.timestamp.state_dict(), **values}
            self._file.write(json.dumps(record) + "\n")

    def batch_end(self, state: State) -> None:
        if self._file is not None:  # state.loss syncs the device: only where it is written
            self._emit(state, "train", {"loss": state.loss, "lr": state.lr})

    def eval_end(self, state: State) -> None:
        self._emit(state, "eval", state.eval_metrics)

    def fit_end(self, state: State) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class LossCurve(Callback):
    """Rank 0 draws the training loss (and the eval loss, if any) to ``loss_curve.png`` at FIT_END."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / "loss_curve.png"
        self._train: list[tuple[int, float]] = []
        self._eval: list[tuple[int, dict[str, float]]] = []

    def batch_end(self, state: State) -> None:
        if dist.get_global_rank() == 0:
            self._train.append((state.timestamp.batch, state.loss))

    def eval_end(self, state: State) -> None:
        self._eval.append((state.timestamp.batch, dict(state.eval_metrics)))

    def fit_end(self, state: State) -> None:
        if dist.get_global_rank() != 0 or not self._train:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        ax.plot(*zip(*self._train), label="train loss", linewidth=1)
        eval_losses = [(b, m["loss"]) for b, m in self._eval if "loss" in m]
        if eval_losses:
            ax.plot(*zip(*eval_losses), "o-", label="eval loss")
        ax.set_xlabel("batch")
        ax.set_ylabel("loss")
        ax.set_title(f"{state.run_name}")
        ax.grid(alpha=0.3)
        ax.legend()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp.png")
        fig.savefig(tmp)
        plt.close(fig)
        tmp.replace(self.path)
        logging.getLogger("lockstep").info("loss curve written to %s", self.path)
