"""Steps/s of ``Trainer.fit`` against a hand-written PyTorch DDP loop, side by side.

Run it with the launcher (2 ranks, gloo, one thread per rank); rank 0 prints the table:

    OMP_NUM_THREADS=1 .venv/bin/lockstep -n 2 benchmarks/trainer_throughput.py

Options: ``--rounds 5 --warmup 20 --steps 200`` (defaults), ``--with-loggers`` to keep the
Trainer's default file loggers (see below). Two ranks on a 2-core machine are noisy (single steps
vary by +-30%, whole runs by +-10%), so on a busy machine prefer many short interleaved runs, e.g.
``--rounds 40 --warmup 10 --steps 50``, and read the median-step-time column.

Both sides train the same model on the same data with the same math:

* model: an MLP of 4 ``nn.Linear`` layers, 512 wide, ReLU between (512 -> 512 -> 512 -> 512 -> 10),
  cross entropy over 10 classes; the same ``lockstep.Model`` subclass and the same initial weights;
* data: random tensors in a ``TensorDataset`` read through a ``DataLoader`` with a
  ``DistributedSampler`` (shuffled, seed 0, ``set_epoch(0)``), 64 samples per rank per step;
* optimizer: AdamW, ``zero_grad(set_to_none=True)`` after each step;
* setting (a) "no microbatching": one forward/backward of 64 per step;
* setting (b) "4 x 16, sync on last": 4 microbatches of 16; each microbatch's mean loss is scaled by
  16/64 before backward; the plain loop runs the first 3 under ``ddp.no_sync()``, the Trainer
  uses ``device_train_microbatch_size=16`` and its default ``single_auto_sync``.

Each round runs every (setting, implementation) pair once, plain and Trainer alternating which goes
first. A run does ``warmup`` steps, a barrier, then ``steps`` timed steps (``time.perf_counter``),
and a barrier before the clock stops; rank 0's time is reported. The table gives, per setting, the
median steps/s of each side and their ratio, the median of the within-round ratios ("pairwise"),
and the median single-step time (robust to bursts of load from other processes). After each pair
the two models' parameters are compared (max |difference|, 0 when both did exactly the same math).

The launcher sets ``LOCKSTEP_RUN_DIRECTORY``, which makes the Trainer add its file loggers (a log
line per rank per step, metrics.jsonl, a loss-curve PNG); a hand-written loop writes none of that,
so by default the benchmark removes the variable before building Trainers, and passes
``progress_bar=False``. ``--with-loggers`` keeps them (written to a temporary folder).

Finally it counts gradient all-reduce passes per optimizer step of the Trainer with microbatching:
a DDP comm hook on ``trainer.state.wrapped_model`` counts its calls and the distinct bucket indices
of each step; passes per step = calls / buckets (1 for ``single_auto_sync``; the control run with
``multi_auto_sync`` shows what 4 passes look like).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep import dist

WIDTH = 512
CLASSES = 10
BATCH = 64  # per rank
SETTINGS = {  # name -> microbatch size (None: the whole batch at once)
    "a: no microbatching": None,
    "b: 4 x 16, sync on last": 16,
}


class MLP(lockstep.Model):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, WIDTH), nn.ReLU(),
            nn.Linear(WIDTH, CLASSES),
        )

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])


def make_model() -> MLP:
    torch.manual_seed(1234)  # the same initial weights for every run and rank
    return MLP()


def make_loader(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, sampler=dist.get_sampler(dataset, shuffle=True, seed=0))


# -- the hand-written loop ------------------------------------------------------------------------


class Clock:
    """Timestamps after each step: a barrier and the start after step ``warmup``, then one
    ``time.perf_counter()`` per step, with a barrier before the last (after step ``warmup + steps``)."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.total = warmup, warmup + steps
        self.ticks: list[float] = []

    def tick(self, step: int) -> bool:
        """Call after step ``step`` (counted from 1); True once the last timed step is done."""
        if step >= self.warmup:
            if step in (self.warmup, self.total):
                dist.barrier()
            self.ticks.append(time.perf_counter())
        return step >= self.total

    @property
    def elapsed(self) -> float:
        return self.ticks[-1] - self.ticks[0]

    @property
    def median_step(self) -> float:
        return statistics.median(b - a for a, b in zip(self.ticks, self.ticks[1:]))


def run_plain(dataset: TensorDataset, micro: int | None, warmup: int, steps: int) -> tuple[Clock, MLP]:
    """Plain DDP: forward, loss, backward (no_sync on all but the last microbatch), step."""
    model = make_model()
    # Like the Trainer, wrap only when there is more than one rank (DDP needs a process group).
    ddp = DistributedDataParallel(model) if dist.get_world_size() > 1 else model
    no_sync = ddp.no_sync if isinstance(ddp, DistributedDataParallel) else contextlib.nullcontext
    optimizer = torch.optim.AdamW(model.parameters())
    loader = make_loader(dataset)
    loader.sampler.set_epoch(0)
    model.train()
    clock = Clock(warmup, steps)
    for step, (x, y) in enumerate(loader, start=1):
        if micro is None:
            loss = F.cross_entropy(ddp((x, y)), y)
            loss.backward()
        else:
            xs, ys = x.split(micro), y.split(micro)
            for i, (xm, ym) in enumerate(zip(xs, ys)):
                scale = len(ym) / len(y)
                if i < len(xs) - 1:
                    with no_sync():
                        (F.cross_entropy(ddp((xm, ym)), ym) * scale).backward()
                else:
                    (F.cross_entropy(ddp((xm, ym)), ym) * scale).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if clock.tick(step):
            return clock, model
    raise RuntimeError(f"the dataset ran out after {step} steps; it needs {warmup + steps}")


# -- the Trainer ----------------------------------------------------------------------------------


class StepTimer(lockstep.Callback):
    """The same clock, ticked at BATCH_END (after the optimizer step and zero_grad)."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.clock = Clock(warmup, steps)

    def batch_end(self, state) -> None:
        self.clock.tick(state.timestamp.batch)


def make_trainer(dataset: TensorDataset, micro: int | None, batches: int, callbacks=(),
                 run_folder: str | None = None, **kwargs) -> lockstep.Trainer:
    model = make_model()
    return lockstep.Trainer(
        model=model,
        train_dataloader=make_loader(dataset),
        max_duration=f"{batches}ba",
        optimizers=torch.optim.AdamW(model.parameters()),
        device="cpu",
        device_train_microbatch_size=micro,
        progress_bar=False,
        callbacks=callbacks,
        run_folder=run_folder,
        **kwargs,
    )


def run_trainer(dataset: TensorDataset, micro: int | None, warmup: int, steps: int,
                run_folder: str | None) -> tuple[Clock, MLP]:
    timer = StepTimer(warmup, steps)
    trainer = make_trainer(dataset, micro, warmup + steps, callbacks=[timer], run_folder=run_folder)
    trainer.fit()
    return timer.clock, trainer.state.model


# -- all-reduce passes per step -------------------------------------------------------------------


class HookCounter(lockstep.Callback):
    """A DDP comm hook state: counts hook calls and distinct buckets, step by step."""

    def __init__(self) -> None:
        self.calls = 0
        self.buckets: set[int] = set()
        self.per_step: list[tuple[int, int]] = []  # (calls, distinct buckets)

    @staticmethod
    def hook(counter: HookCounter, bucket):  # DDP calls hook(state, bucket); the state is the counter
        counter.calls += 1
        counter.buckets.add(bucket.index())
        return allreduce_hook(None, bucket)

    def batch_end(self, state) -> None:
        self.per_step.append((self.calls, len(self.buckets)))
        self.calls, self.buckets = 0, set()


def count_passes(dataset: TensorDataset, steps: int, strategy: str | None) -> tuple[list[float], int]:
    counter = HookCounter()
    trainer = make_trainer(dataset, 16, steps, callbacks=[counter], ddp_sync_strategy=strategy)
    trainer.state.wrapped_model.register_comm_hook(counter, HookCounter.hook)
    trainer.fit()
    passes = [calls / buckets if buckets else float("nan") for calls, buckets in counter.per_step]
    return passes, max(b for _, b in counter.per_step)


# -- main -----------------------------------------------------------------------------------------


@torch.no_grad()
def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--with-loggers", action="store_true",
                        help="keep the Trainer's default file loggers (a run folder) in the timed runs")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be >= 1")

    torch.set_num_threads(1)
    dist.initialize_dist("cpu")
    rank, world = dist.get_global_rank(), dist.get_world_size()
    if world < 2:
        print("note: world size 1, so there is no DDP and nothing to all-reduce; "
              "run it with `lockstep -n 2 benchmarks/trainer_throughput.py`")
    launcher_folder = os.environ.pop("LOCKSTEP_RUN_DIRECTORY", None)
    tmp = tempfile.TemporaryDirectory(prefix="trainer-throughput-") if args.with_loggers else None
    run_folder = tmp.name if tmp else None

    # One epoch holds every step of a run (plus the Trainer's one batch of read-ahead).
    gen = torch.Generator().manual_seed(0)
    n = world * BATCH * (args.warmup + args.steps + 1)
    dataset = TensorDataset(torch.randn(n, WIDTH, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen))

    rates: dict[tuple[str, str], list[float]] = defaultdict(list)  # steps / elapsed, rank 0's clock
    step_ms: dict[tuple[str, str], list[float]] = defaultdict(list)  # median single-step time
    diffs: dict[str, float] = defaultdict(float)
    for r in range(args.rounds):
        for name, micro in SETTINGS.items():
            order = ["plain", "trainer"] if r % 2 == 0 else ["trainer", "plain"]
            models = {}
            for impl in order:
                if impl == "plain":
                    clock, models[impl] = run_plain(dataset, micro, args.warmup, args.steps)
                else:
                    clock, models[impl] = run_trainer(dataset, micro, args.warmup, args.steps, run_folder)
                rates[(name, impl)].append(args.steps / clock.elapsed)
                step_ms[(name, impl)].append(1000 * clock.median_step)
            diffs[name] = max(diffs[name], max_param_diff(models["plain"], models["trainer"]))
        if rank == 0:
            print(f"round {r + 1}/{args.rounds} steps/s: " + "  ".join(
                f"{name[0]}) plain {rates[(name, 'plain')][-1]:.1f} Trainer {rates[(name, 'trainer')][-1]:.1f}"
                for name in SETTINGS), flush=True)

    passes, buckets = count_passes(dataset, 10, None)
    control, _ = count_passes(dataset, 10, "multi_auto_sync")

    if rank == 0:
        print()
        print(f"Trainer.fit vs plain DDP loop: {world} ranks, gloo, {torch.get_num_threads()} thread(s) "
              f"per rank, MLP 4x Linear {WIDTH} wide, batch {BATCH}/rank, AdamW; "
              f"{args.rounds} rounds x {args.steps} timed steps after {args.warmup} warm-up; "
              f"Trainer loggers {'on' if args.with_loggers else 'off'}")
        print(f"{'setting':26s} {'plain steps/s':>13s} {'Trainer steps/s':>15s} {'Trainer/plain':>13s} "
              f"{'pairwise':>9s} {'median step ms: plain':>22s} {'Trainer':>8s} {'ratio':>7s}  {'max|dparam|':>11s}")
        for name in SETTINGS:
            plain, trainer = rates[(name, "plain")], rates[(name, "trainer")]
            mp, mt = statistics.median(plain), statistics.median(trainer)
            pairs = sorted(t / p for p, t in zip(plain, trainer))
            sp, st = statistics.median(step_ms[(name, "plain")]), statistics.median(step_ms[(name, "trainer")])
            print(f"{name:26s} {mp:13.1f} {mt:15.1f} {mt / mp:12.3f}x {statistics.median(pairs):8.3f}x "
                  f"{sp:22.2f} {st:8.2f} {sp / st:6.3f}x  {diffs[name]:11.1e}")
            print(f"{'':26s} runs plain   {' '.join(f'{x:.1f}' for x in plain)}")
            print(f"{'':26s} runs Trainer {' '.join(f'{x:.1f}' for x in trainer)}")
            print(f"{'':26s} pairwise ratios, sorted: {' '.join(f'{x:.3f}' for x in pairs)}")
        print("Trainer/plain: ratio of the median steps/s; pairwise: median over rounds of the ratio "
              "within a round; median step ms: the median single-step time of each run (robust to "
              "bursts of load from other processes), median over runs; its ratio is plain/Trainer, "
              "so above 1 means the Trainer is faster too")
        print()
        print(f"all-reduce passes per step, Trainer, 4 microbatches of 16, default single_auto_sync: "
              f"{' '.join(f'{p:g}' for p in passes)}  (DDP buckets: {buckets})")
        print(f"  control, ddp_sync_strategy='multi_auto_sync':                                   "
              f"{' '.join(f'{p:g}' for p in control)}")
        ok = all(p == 1 for p in passes)
        print(f"all-reduce passes per step = calls / buckets = {passes[-1]:g} "
              f"({'OK: one pass' if ok else 'NOT one pass on every step'})", flush=True)
    if launcher_folder is not None:
        os.environ["LOCKSTEP_RUN_DIRECTORY"] = launcher_folder
    if tmp:
        dist.barrier()
        tmp.cleanup()


if __name__ == "__main__":
    main()
