"""What the Trainer adds to each step, in microseconds, with a model too small to hide it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_overhead.py            # about 1 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_overhead.py --runs 7 --steps 5000
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_overhead.py --sources OLD/src src   # A/B of two trees

One process, no launcher: a Linear(4, 1) trained with AdamW on batches of 4, so a step's own work
is a few hundred microseconds and what the loop around it costs shows. Each run is a fresh
process, and the sides alternate:

* ``loop``: by hand, as the 2-rank benchmarks do: lr set on the param groups, ``clip_grad_norm_``,
  the loss to a ``SummaryWriter`` every step.
* ``trainer-bare``: the Trainer with the progress bar only.
* ``trainer``: the Trainer with a warmup-cosine schedule, ``GradientClipping``, ``SpeedMonitor``,
  ``LRMonitor``, a ``TensorboardLogger`` and the progress bar (what ``gpt_throughput.py`` runs).

Prints the median microseconds per step of each side and the Trainer's extra over the loop: the
figure to set against a real step (about 215 ms for the GPT of ``gpt_throughput.py`` on this CPU).
Timing is wall clock over all steps of ``fit`` or of the loop, after imports and set-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIDES = ("loop", "trainer-bare", "trainer")


def run_side(side: str, steps: int, folder: str) -> float:
    """Microseconds per step of one side, in this process."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lockstep

    class Tiny(lockstep.Model):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
            return self.linear(batch[0])

        def loss(self, outputs: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
            return ((outputs - batch[1]) ** 2).mean()

        def flops_per_batch(self, batch: list[torch.Tensor]) -> float:
            return 6.0 * 5 * batch[0].shape[0]

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 1))
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if side == "loop":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(folder, "tb"))
        start = time.perf_counter()
        for step, batch in enumerate(DataLoader(data, batch_size=4)):
            for group in optimizer.param_groups:
                group["lr"] = 1e-3 * step / steps
            loss = model.loss(model(batch), batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            writer.add_scalar("loss/train/total", loss.item(), step)
        seconds = time.perf_counter() - start
        writer.close()
        return 1e6 * seconds / steps
    from lockstep.algorithms import GradientClipping
    from lockstep.callbacks import LRMonitor, SpeedMonitor
    from lockstep.loggers import TensorboardLogger
    from lockstep.optim import CosineAnnealingWithWarmupScheduler

    full = side == "trainer"
    trainer = lockstep.Trainer(
        model=model, train_dataloader=DataLoader(data, batch_size=4), max_duration="1ep", optimizers=optimizer,
        schedulers=CosineAnnealingWithWarmupScheduler("0.05dur", alpha_f=0.1) if full else None,
        algorithms=[GradientClipping("norm", 1.0)] if full else [],
        callbacks=[SpeedMonitor(window_size=20), LRMonitor()] if full else [],
        loggers=[TensorboardLogger(os.path.join(folder, "tb"))] if full else [], device="cpu")
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    trainer.close()
    return 1e6 * seconds / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--sources", nargs="+", metavar="SRC",
                        help="source folders to compare (each put first on PYTHONPATH), alternating run by run")
    args = parser.parse_args()
    if args.side:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(run_side(args.side, args.steps, folder)))
        return
    sources = args.sources or [None]
    results: dict[tuple[str | None, str], list[float]] = {(src, side): [] for src in sources for side in SIDES}
    for run in range(args.runs):
        for src in sources if run % 2 == 0 else sources[::-1]:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if src is not None:
                env["PYTHONPATH"] = os.path.abspath(src)
            for side in SIDES if run % 2 == 0 else SIDES[::-1]:
                out = subprocess.run([sys.executable, __file__, "--side", side, "--steps", str(args.steps)],
                                     env=env, capture_output=True, text=True, check=True)
                results[src, side].append(json.loads(out.stdout.strip().splitlines()[-1]))
                label = f"{src} " if src else ""
                print(f"run {run + 1}/{args.runs} {label}{side:13} {results[src, side][-1]:8.1f} us/step", flush=True)
    print(f"\n{args.steps} steps per run, {args.runs} runs, medians:")
    for src in sources:
        loop = statistics.median(results[src, "loop"])
        for side in SIDES:
            median = statistics.median(results[src, side])
            extra = "" if side == "loop" else f"  ({median - loop:+.1f} us/step against the loop)"
            print(f"{src + ': ' if src else ''}{side:13} {median:8.1f} us/step{extra}")

if __name__ == "__main__":
    main()
