"""The Trainer and a hand-written DDP loop taking turns inside one 2-rank job: ratios to about 1%.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_ab.py                 # about 20 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_ab.py --workloads plain --jobs 1
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_ab.py --workloads big-save --keep --jobs 1  # 12 min

``trainer_throughput.py`` runs each side as its own job; on a shared 2-core machine, jobs a minute
apart differ by 5-15%, more than the gaps it is after. Here one job under ``lockstep -n 2
--run_directory`` (the Trainer's defaults: log files, ``metrics.jsonl``, the progress bar) holds
both sides, each with its own model, optimizer and loader over the same data, and they alternate
in windows of ``--window`` steps: a callback at the Trainer's BATCH_END runs the plain loop's
window (the plain loop of ``throughput_job.py``: DDP, ``no_sync``, ``torch.save`` on rank 0),
then hands back. So each Trainer window has plain windows either side of it, and the drift of
the machine falls out of their ratio.

Every window starts and ends at a barrier. A Trainer window ends once its checkpoint writes and
its loggers' threads have finished what it gave them, so none of its background work runs in the
plain window (which makes it pay for work that would otherwise overlap training). The first pair
is warm-up (the Trainer's holds the start of ``fit``). Reported per workload, over all jobs: the
median of the ratios (each Trainer window's steps/s over the plain loop's in the windows either side),
a 95% bootstrap interval of that median, the ratio of the two sides' total times, the Trainer's
median step, and whether both sides ended with bitwise equal weights. The plain loop runs under
lockstep's launcher here, not torchrun; ``trainer_throughput.py`` shows that neither launcher
takes measurable CPU during training.

``--keep`` adds what saving costs the Trainer: ``big`` and ``big-save`` both against the same plain
loop that does not save, in one job each; the ratio of their medians is what saving keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lockstep
from lockstep import dist

HERE = Path(__file__).resolve().parent
WORKLOADS = ["plain", "accum", "save", "big", "big-save", "tiny"]
# Short windows and many of them: on this machine a window's rate varies by ~10% whether it lasts
# 0.4 s or 2 s, so for the same time, more pairs give a tighter median. With the plain loop on both
# sides, the median of one job of 60 pairs landed anywhere in 0.98-1.02; 3 jobs of 150 narrow that. A multiple of 10 steps:
# every Trainer window of a saving workload holds the same number of saves.
WINDOW = {"plain": 20, "accum": 20, "save": 20, "big": 10, "big-save": 10, "tiny": 100}  # ~0.35 s; ~3 s for big
PAIRS = {"plain": 150, "accum": 150, "save": 150, "big": 40, "big-save": 40, "tiny": 100}


class Turns(lockstep.Callback):
    """At the BATCH_END of every ``window``-th batch, the plain loop's window."""

    def __init__(self, plain: Any, window: int, pairs: int) -> None:
        self.plain, self.window, self.pairs = plain, window, pairs
        self.trainer: Any = None
        self.windows: list[tuple[float, float]] = []  # (Trainer seconds, plain seconds right after)
        self._start = 0.0

    def _tick(self) -> float:
        dist.barrier()
        return time.perf_counter()

    def batch_end(self, state: Any, logger: Any) -> None:
        if state.timestamp.batch % self.window:
            return
        # The Trainer's background work is charged to its own window, not to the plain one.
        if self.trainer.saver is not None:
            self.trainer.saver.wait()
        for destination in self.trainer.logger.destinations:
            destination.flush()
        trainer_end = self._tick()
        for _ in range(self.window):
            self.plain.train_step()
            self.plain.save()
        plain_end = self._tick()
        if self._start:
            self.windows.append((trainer_end - self._start, plain_end - trainer_end))
        self._start = plain_end


def job(trainer_workload: str, plain_workload: str, window: int, pairs: int, out: Path, bucket_view: bool) -> None:
    """One rank of the job (under ``lockstep -n 2``)."""
    import torch

    import throughput_job as tj

    torch.set_num_threads(1)
    dist.initialize_dist("cpu")
    steps = window * (pairs + 1)  # the first Trainer window has no plain window before it
    work, reference = tj.WORKLOADS[trainer_workload], tj.WORKLOADS[plain_workload]
    plain = tj.PlainLoop(reference, steps, out / "plain-checkpoints", bucket_view=bucket_view)
    plain.model.train()
    turns = Turns(plain, window, pairs)
    model = tj.make_model(work.width)
    saving = {"save_folder": str(out / "checkpoints"), "save_interval": f"{work.save_every}ba",
              "save_num_checkpoints_to_keep": 1} if work.save_every else {}
    trainer = lockstep.Trainer(model=model, train_dataloader=tj.make_loader(tj.make_data(work.width, steps)),
                               max_duration=f"{steps}ba", optimizers=torch.optim.AdamW(model.parameters()),
                               device_train_microbatch_size=work.microbatch, callbacks=[turns], **saving)
    turns.trainer = trainer
    trainer.fit()
    dist.barrier()
    if dist.get_global_rank() == 0:
        mine, theirs = model.state_dict(), plain.model.state_dict()
        equal = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        same_work = work.width == reference.width and work.microbatch == reference.microbatch
        (out / "result.json").write_text(json.dumps({"windows": turns.windows, "window": window,
                                                     "bitwise": equal if same_work else None}))


def run_job(trainer_workload: str, plain_workload: str, window: int, pairs: int, root: Path,
            bucket_view: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{trainer_workload}-", dir=root))
    command = [sys.executable, "-m", "lockstep", "-n", "2", "--run_directory", str(out / "run"), __file__,
               "--job", trainer_workload, plain_workload, "--window", str(window), "--pairs", str(pairs),
               "--out", str(out)] + (["--plain-bucket-view"] if bucket_view else [])
    proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{trainer_workload} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def ratios(results: list[dict]) -> list[float]:
    """Each Trainer window's steps/s over the plain loop's in the windows either side of it (the
    mean of their times, which cancels a drift of the machine's speed): plain seconds over Trainer
    seconds. The first Trainer window's neighbour before it is warm-up, so it has only the one after."""
    out = []
    for result in results:
        windows = result["windows"]
        for i, (trainer, plain) in enumerate(windows):
            before = windows[i - 1][1] if i else plain
            out.append((before + plain) / 2 / trainer)
    return out


def interval(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median (fixed seed: the same data gives the same figures)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def describe(name: str, results: list[dict]) -> str:
    r = ratios(results)
    low, high = interval(r)
    trainer = sum(t for result in results for t, _ in result["windows"])
    plain = sum(p for result in results for _, p in result["windows"])
    step_ms = 1000 * statistics.median(t for result in results for t, _ in result["windows"]) / results[0]["window"]
    bitwise = {result["bitwise"] for result in results}
    weights = "n/a" if bitwise == {None} else "bitwise" if bitwise == {True} else "DIFFER"
    return (f"{name:22s} {len(r):5d} {statistics.median(r):7.3f}x {low:6.3f}-{high:.3f}x {plain / trainer:7.3f}x "
            f"{step_ms:8.2f} {weights:>8s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["plain", "accum", "save"])
    parser.add_argument("--keep", action="store_true", help="also big and big-save against a plain loop that does not save")
    parser.add_argument("--jobs", type=int, default=3, help="jobs per workload")
    parser.add_argument("--pairs", type=int, default=None, help="timed window pairs per job (default: per workload)")
    parser.add_argument("--window", type=int, default=None, help="steps per window (default: per workload)")
    parser.add_argument("--plain-bucket-view", action="store_true",
                        help="the plain loop's DDP keeps gradients as views of its buckets, as the Trainer's does")
    parser.add_argument("--job", nargs=2, metavar=("TRAINER", "PLAIN"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(*args.job, args.window, args.pairs, args.out, args.plain_bucket_view)
    if args.jobs < 1 or (args.pairs is not None and args.pairs < 1) or (args.window is not None and args.window < 10):
        parser.error("--jobs and --pairs must be >= 1, --window >= 10 (a save every 10 steps fits in it)")

    runs = [(w, w) for w in args.workloads]
    if args.keep:
        runs += [("big", "big"), ("big-save", "big")]
    results: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory(prefix="trainer-ab-") as tmp:
        for j in range(args.jobs):
            for trainer_workload, plain_workload in runs:
                window, pairs = args.window or WINDOW[trainer_workload], args.pairs or PAIRS[trainer_workload]
                result = run_job(trainer_workload, plain_workload, window, pairs, Path(tmp), args.plain_bucket_view)
                results[(trainer_workload, plain_workload)].append(result)
                print(f"job {j + 1}/{args.jobs} Trainer {trainer_workload:9s} vs plain {plain_workload:9s} median "
                      f"{statistics.median(ratios([result])):.3f}x", flush=True)
    print()
    plain = "a plain DDP loop" + (" with gradient_as_bucket_view" if args.plain_bucket_view else "")
    print(f"Trainer (lockstep -n 2, defaults) and {plain} taking turns in one job, 2 ranks, gloo, "
          f"{time.strftime('%Y-%m-%d')}; {args.jobs} jobs per workload")
    print(f"{'Trainer vs plain':22s} {'pairs':>5s} {'median':>8s} {'95% interval':>13s} {'overall':>8s} "
          f"{'Trainer ms/step':>8s} {'weights':>8s}")
    for (trainer_workload, plain_workload), rs in results.items():
        print(describe(f"{trainer_workload} vs {plain_workload}", rs))
    if args.keep:
        own = statistics.median(ratios(results[("big-save", "big")])) / statistics.median(ratios(results[("big", "big")]))
        print(f"saving every 10 steps keeps {own:.3f}x of the Trainer's own no-save steps/s "
              f"(each against the same plain loop that does not save)")


if __name__ == "__main__":
    main()
