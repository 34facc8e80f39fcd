"""One timed training job of ``trainer_throughput.py``: the Trainer or a hand-written DDP loop.

Not meant to be run by hand: ``trainer_throughput.py`` starts it under ``lockstep -n 2`` (the
Trainer, with its default settings) or under ``torchrun`` (the plain loop), and reads what rank 0
writes to ``--out``: ``result.json`` (steps/s, median step time) and ``weights.pt`` (the final
parameters, compared bitwise between the two).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep import dist

CLASSES = 10
BATCH = 64  # per rank


@dataclass(frozen=True)
class Workload:
    width: int
    microbatch: int | None  # None: the whole batch in one forward/backward
    save_every: int | None  # None: no checkpoints


WORKLOADS = {
    "plain": Workload(512, None, None),
    "accum": Workload(512, 16, None),
    "save": Workload(512, None, 10),
    "big": Workload(2048, None, None),
    "big-save": Workload(2048, None, 10),
    "tiny": Workload(16, None, None),  # next to no compute: what is left is the per-step overhead
}


class MLP(lockstep.Model):
    """4 x Linear, ReLU between, cross entropy over 10 classes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, CLASSES))

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch[1])


def launcher_cpu() -> float:
    """CPU seconds so far of this rank's parent: the launcher (lockstep) or the agent (torchrun)."""
    fields = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


class Clock:
    """A barrier and a start time after step ``warmup``; a time per step after that; at step
    ``warmup + steps`` a barrier before the last time. Beside the wall clock, the CPU time of
    this process (all its threads) and of its launcher between the first and the last tick."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.total = warmup, warmup + steps
        self.ticks: list[float] = []
        self.cpu: list[float] = []
        self.launcher: list[float] = []

    def tick(self, step: int, before_last: Any = None) -> bool:
        """Call after step ``step`` (from 1); True once the last timed step is done."""
        if step >= self.warmup:
            if step == self.total and before_last is not None:
                before_last()
            if step in (self.warmup, self.total):
                dist.barrier()
                self.cpu.append(time.process_time())
                self.launcher.append(launcher_cpu())
            self.ticks.append(time.perf_counter())
        return step >= self.total

    def result(self) -> dict[str, float]:
        """Rank 0's timings, and CPU ms per step summed over the ranks (a collective: every rank calls it)."""
        steps = len(self.ticks) - 1
        cpu = dist.all_gather_object(self.cpu[-1] - self.cpu[0])
        return {"steps_per_s": steps / (self.ticks[-1] - self.ticks[0]),
                "median_step_ms": 1000 * statistics.median(b - a for a, b in zip(self.ticks, self.ticks[1:])),
                "cpu_ms_per_step": 1000 * sum(cpu) / steps,
                "launcher_cpu_ms_per_step": 1000 * (self.launcher[-1] - self.launcher[0]) / steps}


def make_data(width: int, steps: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    n = dist.get_world_size() * BATCH * (steps + 1)  # one epoch holds the run, and the read-ahead
    return TensorDataset(torch.randn(n, width, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen))


def make_model(width: int) -> MLP:
    torch.manual_seed(1234)  # the same initial weights in every run and on every rank
    return MLP(width)


def make_loader(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, sampler=dist.get_sampler(dataset, shuffle=True, seed=0))


class PlainLoop:
    """What a user writes by hand: DDP, no_sync on all but the last microbatch, torch.save on rank 0."""

    def __init__(self, work: Workload, steps: int, folder: Path, bucket_view: bool = False) -> None:
        self.work, self.folder = work, folder
        self.model = make_model(work.width)
        self.ddp = DistributedDataParallel(self.model, gradient_as_bucket_view=bucket_view)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        loader = make_loader(make_data(work.width, steps))
        loader.sampler.set_epoch(0)
        self.batches = iter(loader)
        self.step = 0

    def train_step(self) -> None:
        """One optimizer step on the next batch; a checkpoint after it when the workload saves."""
        work, ddp = self.work, self.ddp
        x, y = next(self.batches)
        if work.microbatch is None:
            F.cross_entropy(ddp((x, y)), y).backward()
        else:
            xs, ys = x.split(work.microbatch), y.split(work.microbatch)
            for i, (xm, ym) in enumerate(zip(xs, ys)):
                with ddp.no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
                    (F.cross_entropy(ddp((xm, ym)), ym) * (len(ym) / len(y))).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def save(self) -> None:
        """torch.save of the model and optimizer on rank 0, when the workload saves at this step."""
        if self.work.save_every and self.step % self.work.save_every == 0 and dist.get_global_rank() == 0:
            self.folder.mkdir(exist_ok=True)
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                       self.folder / "checkpoint.pt")


def run_plain(work: Workload, warmup: int, steps: int, folder: Path) -> tuple[Clock, nn.Module]:
    """The plain loop for ``warmup + steps`` steps, timed."""
    loop = PlainLoop(work, warmup + steps, folder)
    clock = Clock(warmup, steps)
    loop.model.train()
    while True:
        loop.train_step()
        if clock.tick(loop.step):
            return clock, loop.model
        loop.save()


class StepTimer(lockstep.Callback):
    """The same clock at BATCH_END; before the last tick it waits for any checkpoint still being
    written in the background, so that the Trainer is charged for all of its saves."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.trainer: lockstep.Trainer | None = None

    def batch_end(self, state: Any, logger: Any) -> None:
        saver = self.trainer.saver if self.trainer is not None else None
        self.clock.tick(state.timestamp.batch, before_last=saver.wait if saver else None)


def run_trainer(work: Workload, warmup: int, steps: int, folder: Path) -> tuple[Clock, nn.Module]:
    """The Trainer with its defaults (under the launcher: a run directory with its loggers, and
    the progress bar); checkpoints, when the workload has them, every ``save_every`` batches."""
    model = make_model(work.width)
    timer = StepTimer(Clock(warmup, steps))
    saving = {"save_folder": str(folder), "save_interval": f"{work.save_every}ba",
              "save_num_checkpoints_to_keep": 1} if work.save_every else {}
    trainer = lockstep.Trainer(model=model, train_dataloader=make_loader(make_data(work.width, warmup + steps)),
                               max_duration=f"{warmup + steps}ba", optimizers=torch.optim.AdamW(model.parameters()),
                               device_train_microbatch_size=work.microbatch, callbacks=[timer], **saving)
    timer.trainer = trainer
    trainer.fit()
    return timer.clock, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["plain", "trainer"], required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.initialize_dist("cpu")
    work = WORKLOADS[args.workload]
    folder = args.out / "checkpoints"  # the same on every rank
    run = run_plain if args.impl == "plain" else run_trainer
    clock, model = run(work, args.warmup, args.steps, folder)
    result = clock.result()
    if dist.get_global_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / "weights.pt")
        (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
