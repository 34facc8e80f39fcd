"""Steps/s of the Trainer under ``lockstep -n 2`` against a hand-written DDP loop under torchrun.

Run it without a launcher; it starts every job itself:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_throughput.py            # about 15 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_throughput.py --runs 3 --workloads plain accum

Each job is a fresh 2-rank run of ``benchmarks/throughput_job.py`` (gloo, one thread per rank):

* **Trainer**: ``lockstep -n 2 --run_directory TMP throughput_job.py --impl trainer``, so the Trainer
  runs as a user gets it: a run directory (a log file per rank, ``metrics.jsonl``, the loss curve)
  and the progress bar.
* **plain**: ``torchrun --standalone --nproc_per_node 2 throughput_job.py --impl plain``: DDP,
  ``no_sync`` on all but the last microbatch, ``torch.save`` of the model and optimizer state
  on rank 0 where the workload saves. No logging.

Both train an MLP (4 x Linear, ReLU between) with AdamW, 64 samples per rank per step from a
shuffled ``DistributedSampler``, from the same initial weights. Workloads:

=========== ====================================================================================
plain       width 512, one forward/backward per step
accum       width 512, 4 microbatches of 16 (the plain loop: ``no_sync`` on the first 3)
save        width 512, a checkpoint every 10 steps (the Trainer keeps 1; it writes in the
            background and fsyncs; the plain loop's rank 0 calls ``torch.save``)
big         width 2048 (about 200 MB of weights and AdamW state), no checkpoints
big-save    width 2048, a checkpoint every 10 steps (about 200 MB each)
=========== ====================================================================================

Runs alternate which implementation goes first. A run times ``--steps`` steps after ``--warmup``
(rank 0's clock between two barriers; under saving, the Trainer waits for its last background
write before the final barrier). The table gives the median steps/s of each side over the runs,
their ratio, the median of the within-run ratios, and whether the final weights of every Trainer
run were bitwise equal to the plain loop's. ``big-save`` is also compared with the Trainer's own
``big`` (what saving costs it).
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
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
JOB = HERE / "throughput_job.py"
WORKLOADS = ["plain", "accum", "save", "big", "big-save"]
BIG_STEPS = 200  # 2048-wide steps are ~8x slower; 200 of them still hold 20 checkpoints


def command(impl: str, workload: str, warmup: int, steps: int, out: Path) -> list[str]:
    job = [str(JOB), "--impl", impl, "--workload", workload, "--warmup", str(warmup), "--steps", str(steps),
           "--out", str(out)]
    if impl == "trainer":
        return [sys.executable, "-m", "lockstep", "-n", "2", "--run_directory", str(out / "run"), *job]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *job]


def run_job(impl: str, workload: str, warmup: int, steps: int, root: Path) -> tuple[dict, dict]:
    out = Path(tempfile.mkdtemp(prefix=f"{impl}-{workload}-", dir=root))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command(impl, workload, warmup, steps, out), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{impl} {workload} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    return result, torch.load(out / "weights.pt")


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=400, help="timed steps of the 512-wide workloads")
    parser.add_argument("--big-steps", type=int, default=BIG_STEPS, help="timed steps of big and big-save")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=WORKLOADS)
    args = parser.parse_args()
    if min(args.runs, args.warmup, args.steps, args.big_steps) < 1:
        parser.error("--runs, --warmup, --steps and --big-steps must be >= 1")

    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    step_ms: dict[tuple[str, str], list[float]] = defaultdict(list)
    cpu: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    equal: dict[str, bool] = defaultdict(lambda: True)
    with tempfile.TemporaryDirectory(prefix="trainer-throughput-") as tmp:
        for r in range(args.runs):
            for workload in args.workloads:
                steps = args.big_steps if workload.startswith("big") else args.steps
                order = ["plain", "trainer"] if r % 2 == 0 else ["trainer", "plain"]
                weights = {}
                for impl in order:
                    result, weights[impl] = run_job(impl, workload, args.warmup, steps, Path(tmp))
                    rates[(workload, impl)].append(result["steps_per_s"])
                    step_ms[(workload, impl)].append(result["median_step_ms"])
                    cpu[(workload, impl)].append((result["cpu_ms_per_step"], result["launcher_cpu_ms_per_step"]))
                equal[workload] &= bitwise_equal(weights["plain"], weights["trainer"])
                print(f"run {r + 1}/{args.runs} {workload:9s} plain {rates[(workload, 'plain')][-1]:6.2f} "
                      f"Trainer {rates[(workload, 'trainer')][-1]:6.2f} steps/s", flush=True)
    report(args, rates, step_ms, equal)
    report_cpu(args, cpu)


def report_cpu(args: argparse.Namespace, cpu: dict) -> None:
    """CPU per step: what each side would cost on a machine no one else is using."""
    print()
    print("CPU ms per timed step (medians): both ranks' processes, every thread; and their launcher")
    print(f"{'workload':10s} {'ranks plain':>11s} {'Trainer':>8s} {'ratio':>7s} {'launcher plain':>14s} {'Trainer':>8s}")
    for workload in args.workloads:
        plain, trainer = cpu[(workload, "plain")], cpu[(workload, "trainer")]
        rp, rt = (statistics.median(c for c, _ in side) for side in (plain, trainer))
        lp, lt = (statistics.median(l for _, l in side) for side in (plain, trainer))
        print(f"{workload:10s} {rp:11.2f} {rt:8.2f} {rp / rt:6.3f}x {lp:14.3f} {lt:8.3f}")
        print(f"{'':10s} runs plain   {' '.join(f'{c:.2f}' for c, _ in plain)}")
        print(f"{'':10s} runs Trainer {' '.join(f'{c:.2f}' for c, _ in trainer)}")


def report(args: argparse.Namespace, rates: dict, step_ms: dict, equal: dict) -> None:
    print()
    print(f"Trainer (lockstep -n 2, defaults) vs plain DDP loop (torchrun), 2 ranks, gloo, 1 thread each, "
          f"{time.strftime('%Y-%m-%d')}; {args.runs} runs, {args.warmup} warm-up steps; medians")
    print(f"{'workload':10s} {'steps':>5s} {'plain steps/s':>13s} {'Trainer':>8s} {'ratio':>7s} {'pairwise':>9s} "
          f"{'step ms plain':>13s} {'Trainer':>8s} {'weights':>8s}")
    for workload in args.workloads:
        plain, trainer = rates[(workload, "plain")], rates[(workload, "trainer")]
        mp, mt = statistics.median(plain), statistics.median(trainer)
        pairwise = statistics.median(t / p for p, t in zip(plain, trainer))
        steps = args.big_steps if workload.startswith("big") else args.steps
        print(f"{workload:10s} {steps:5d} {mp:13.2f} {mt:8.2f} {mt / mp:6.3f}x {pairwise:8.3f}x "
              f"{statistics.median(step_ms[(workload, 'plain')]):13.2f} "
              f"{statistics.median(step_ms[(workload, 'trainer')]):8.2f} "
              f"{'bitwise' if equal[workload] else 'DIFFER':>8s}")
        print(f"{'':10s} runs plain   {' '.join(f'{x:.2f}' for x in plain)}")
        print(f"{'':10s} runs Trainer {' '.join(f'{x:.2f}' for x in trainer)}")
    if {"big", "big-save"} <= set(args.workloads):
        own = statistics.median(rates[("big-save", "trainer")]) / statistics.median(rates[("big", "trainer")])
        plain = statistics.median(rates[("big-save", "plain")]) / statistics.median(rates[("big", "plain")])
        print(f"saving every 10 steps keeps {own:.3f}x of the Trainer's own no-save steps/s "
              f"(the plain loop with torch.save keeps {plain:.3f}x of its own)")


if __name__ == "__main__":
    main()
