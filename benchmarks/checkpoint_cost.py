"""What checkpoints cost: save/load time and bytes against plain torch.save/torch.load, and the
steps/s of training that saves every N steps against training that does not.

Run it with the launcher (2 ranks, gloo, one thread per rank); rank 0 prints the tables:

    OMP_NUM_THREADS=1 .venv/bin/lockstep -n 2 benchmarks/checkpoint_cost.py

Options: ``--rounds 9`` (save/load pairs), ``--train-rounds 5 --steps 200 --every 10 50``
(``--train-rounds 0`` prints only the save/load table).

Model and data are the Trainer benchmark's (``trainer_throughput.py``): an MLP of 4 layers 512 wide
with AdamW state (after one step, so both moment buffers exist), 64 samples per rank per step.

Save/load, alternating which goes first in each round, medians over rounds, rank 0's clock:

* lockstep save: ``CheckpointSaver.save`` as the Trainer calls it: gather every rank's RNG state,
  rank 0 writes model + optimizer + timestamp + RNG states to a temporary file; training goes on
  while a background thread fsyncs it, renames it, fsyncs the folder and moves the latest pointer.
  "ours save" is the time training is blocked; "ours save, durable" is a save that is waited for
  (``save(wait=True)`` then ``saver.wait()``, as at the end of training and on preemption: written
  and published with no in-memory copy, then one all-reduce).
* plain save: rank 0 ``torch.save({"model": ..., "optimizer": ...}, path)`` to a new file (as a loop
  saving ``ckpt-{step}.pt`` does), then the barrier. It does not fsync, so the table also shows
  plain save + fsync, which is what durability costs by itself, and a save that rewrites one
  existing file (cheaper on file systems where allocating a new file's blocks is slow).
* lockstep load: the Trainer's ``load_path`` code: every rank checks the file's CRCs, loads it with
  ``weights_only=True`` and restores model, optimizer and timestamp.
* plain load: every rank ``torch.load(path, weights_only=True)`` and ``load_state_dict`` into the
  model and optimizer.

Training cost: ``Trainer.fit`` for ``warmup + steps`` batches without saving, with
``save_interval=f"{N}ba"``, and with a callback that does what a hand-written loop does (rank 0
``torch.save`` every N batches, synchronously, no fsync), in rotating order; the ratio is steps/s
over steps/s without saving (median over rounds). Saves during the timed steps are included, so
it is the whole price.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lockstep  # noqa: E402
from lockstep import dist  # noqa: E402
from lockstep import rng  # noqa: E402
from lockstep.checkpoint import loader  # noqa: E402
from throughput_job import BATCH, CLASSES, Clock, StepTimer, make_loader, make_model  # noqa: E402

WIDTH = 512  # throughput_job's "plain" workload


def make_trainer(dataset: TensorDataset, batches: int, callbacks: list[lockstep.Callback] | None = None,
                 **saving: object) -> lockstep.Trainer:
    """The Trainer of throughput_job's "plain" workload over ``dataset`` for ``batches`` batches."""
    model = make_model(WIDTH)
    trainer = lockstep.Trainer(model=model, train_dataloader=make_loader(dataset), max_duration=f"{batches}ba",
                               optimizers=torch.optim.AdamW(model.parameters()), callbacks=callbacks or [],
                               **saving)
    for callback in callbacks or []:
        if isinstance(callback, StepTimer):
            callback.trainer = trainer  # it waits for the background saves before its last tick
    return trainer


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def shared_tmp() -> Path:
    names = [tempfile.mkdtemp(prefix="lockstep-ckpt-bench-") if dist.get_global_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return Path(names[0])


def save_load(dataset: TensorDataset, rounds: int) -> None:
    tmp = shared_tmp()
    trainer = make_trainer(dataset, 1, save_folder=str(tmp / "ls"), save_overwrite=True,
                           save_latest_filename="latest.pt")
    trainer.fit()  # one step: AdamW's state exists; this also writes the end-of-training checkpoint
    state, saver = trainer.state, trainer.saver
    model, optimizer = state.model, state.optimizers[0]
    ours_path = saver.where.local / "ep0-ba1-rank0.pt"
    plain_path = tmp / "plain.pt"
    is_zero = dist.get_global_rank() == 0

    def ours_save(durable: bool) -> None:
        saver.save(state, {"rng": rng.capture(), "epoch_rng": None, "fetch_rng": None},
                   trainer.layout, wait=durable)
        if durable:
            saver.wait()

    def plain_save(fsync: bool, new_file: bool = True) -> None:
        if not is_zero:
            return
        if new_file:  # as a loop saving ckpt-{step}.pt would; a new file costs more than a rewrite
            plain_path.unlink(missing_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain_path)
        if fsync:
            with open(plain_path, "rb+") as f:
                os.fsync(f.fileno())

    def ours_load() -> None:
        loader.load(str(ours_path), state, trainer.layout, run_name=state.run_name, weights_only=False,
                    strict=True)

    def plain_load() -> None:
        content = torch.load(plain_path, weights_only=True)
        model.load_state_dict(content["model"])
        optimizer.load_state_dict(content["optimizer"])

    times: dict[str, list[float]] = {k: [] for k in ("ours save", "ours save, durable", "plain save",
                                                     "plain save + fsync", "plain save, same file",
                                                     "ours load", "plain load")}
    for r in range(rounds + 1):
        pairs = [("ours save", lambda: ours_save(False)), ("ours save, durable", lambda: ours_save(True)),
                 ("plain save", lambda: plain_save(False)), ("plain save + fsync", lambda: plain_save(True)),
                 ("plain save, same file", lambda: plain_save(False, new_file=False))]
        pairs = pairs if r % 2 else pairs[::-1]
        for name, fn in pairs:
            t = timed(fn)
            saver.wait()  # a background publish must not overlap the next measurement
            if r:  # round 0 warms the page cache and allocator
                times[name].append(t)
        loads = [("ours load", ours_load), ("plain load", plain_load)]
        for name, fn in (loads if r % 2 else loads[::-1]):
            t = timed(fn)
            if r:
                times[name].append(t)
    if is_zero:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"save/load, {dist.get_world_size()} ranks, MLP {WIDTH}x4 + AdamW, median of {rounds} rounds")
        print(f"  file bytes: lockstep {ours_path.stat().st_size:,}  plain {plain_path.stat().st_size:,}")
        for k, v in med.items():
            print(f"  {k:<20} {v:8.2f} ms")
        print(f"  save ratio, training blocked: lockstep / plain torch.save   "
              f"{med['ours save'] / med['plain save']:.2f}x")
        print(f"  save ratio, until durable: lockstep / torch.save + fsync  "
              f"{med['ours save, durable'] / med['plain save + fsync']:.2f}x")
        print(f"  load ratio lockstep / plain torch.load          {med['ours load'] / med['plain load']:.2f}x")
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()


class PlainSaver(lockstep.Callback):
    """What a hand-written loop does: rank 0 ``torch.save``s model and optimizer every N batches to
    a new file, synchronously, with no fsync."""

    def __init__(self, folder: Path, every: int) -> None:
        self.folder, self.every = folder, every

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch % self.every == 0 and dist.get_global_rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.save({"model": state.model.state_dict(), "optimizer": state.optimizers[0].state_dict()},
                       self.folder / f"ckpt-{state.timestamp.batch.value}.pt")


def train_cost(dataset: TensorDataset, rounds: int, warmup: int, steps: int, every: list[int]) -> None:
    tmp = shared_tmp()
    rates: dict[str, list[float]] = {"none": []}
    for n in every:
        rates[f"lockstep every {n}"] = []
        rates[f"plain every {n}"] = []
    for r in range(rounds):
        order = list(rates) if r % 2 == 0 else list(rates)[::-1]
        for name in order:
            timer = StepTimer(Clock(warmup, steps))
            callbacks: list[lockstep.Callback] = [timer]
            kwargs = {}
            folder = tmp / f"{name}-{r}".replace(" ", "")
            if name.startswith("lockstep"):
                kwargs = dict(save_folder=str(folder), save_interval=f"{name.split()[-1]}ba")
            elif name.startswith("plain"):
                callbacks.append(PlainSaver(folder, int(name.split()[-1])))
            trainer = make_trainer(dataset, warmup + steps, callbacks, **kwargs)
            trainer.fit()
            rates[name].append(steps / (timer.clock.ticks[-1] - timer.clock.ticks[0]))
    if dist.get_global_rank() == 0:
        base = statistics.median(rates["none"])
        print(f"\ntraining, {dist.get_world_size()} ranks, {steps} timed steps, median of {rounds} rounds")
        for name, values in rates.items():
            rate = statistics.median(values)
            print(f"  save {name:<18} {rate:8.1f} steps/s  ratio {rate / base:.3f}")
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--train-rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, nargs="+", default=[10, 50])
    args = p.parse_args()
    os.environ.pop("LOCKSTEP_RUN_DIRECTORY", None)  # no file loggers, as in the Trainer benchmark
    lockstep.dist.initialize_dist("cpu")
    g = torch.Generator().manual_seed(0)
    n = (args.warmup + args.steps + 1) * BATCH * dist.get_world_size()
    dataset = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    save_load(dataset, args.rounds)
    if args.train_rounds > 0:  # --train-rounds 0: only the save/load table
        train_cost(dataset, args.train_rounds, args.warmup, args.steps, args.every)


if __name__ == "__main__":
    main()
