"""What a small Python call costs right after a training step has evicted the caches.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cold_calls.py        # a few seconds

A step's kernels stream the model's parameters, gradients and optimizer state through the caches,
so the code and objects of whatever Python runs between two steps are fetched from memory again.
A microbenchmark that calls the same function in a loop never sees that, and prices the Trainer's
per-step bookkeeping several times too low. Here each call is timed once right after a pass over
a ``--megabytes`` buffer (cold) and once again straight after (hot); medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lockstep import batch as batches
from lockstep import progress
from lockstep.time import Time, Timestamp, is_reached


def noop() -> None:
    pass


def cases() -> dict[str, Callable[[], Any]]:
    timestamp, limit = Timestamp(batch=3), Time.from_input("100ba")
    pair, cpu = (torch.ones(2), torch.ones(2)), torch.device("cpu")
    return {
        "a no-op function": noop,
        "time.monotonic": time.monotonic,
        "progress.heartbeat (no launcher: returns at once)": lambda: progress.heartbeat(5),
        "batch.to_device (CPU)": lambda: batches.to_device(pair, cpu),
        "time.is_reached": lambda: is_reached(timestamp, limit),
        "Timestamp.to_next_batch": lambda: timestamp.to_next_batch(64, 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=20, help="what a step streams through the caches")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    buffer = torch.ones(args.megabytes * (1 << 20) // 4)
    print(f"median µs per call, cold (after a pass over {args.megabytes} MB) and hot, {args.rounds} rounds")
    for name, call in cases().items():
        cold, hot = [], []
        for _ in range(args.rounds):
            buffer.add_(1.0)
            start = time.perf_counter_ns()
            call()
            middle = time.perf_counter_ns()
            call()
            cold.append(middle - start)
            hot.append(time.perf_counter_ns() - middle)
        print(f"{name:50s} cold {statistics.median(cold) / 1e3:6.2f}   hot {statistics.median(hot) / 1e3:6.2f}")


if __name__ == "__main__":
    main()
