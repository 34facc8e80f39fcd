"""Whole-process wall time of `lockstep -n N probe.py` vs `torchrun --nproc_per_node N probe.py`.

Runs the two alternately, so both see the same machine load, and reports medians and their ratio:

    .venv/bin/python benchmarks/launcher_overhead.py --runs 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = Path(__file__).with_name("probe.py")


def timed(cmd: list[str], cwd: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    bindir = Path(sys.executable).parent
    commands = {
        "lockstep": [str(bindir / "lockstep"), "-n", str(args.nproc), str(PROBE)],
        "torchrun": [str(bindir / "torchrun"), "--nproc_per_node", str(args.nproc), str(PROBE)],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    with tempfile.TemporaryDirectory() as cwd:
        for cmd in commands.values():  # warm the page cache for both
            timed(cmd, cwd)
        for _ in range(args.runs):
            for name, cmd in commands.items():
                times[name].append(timed(cmd, cwd))
        shutil.rmtree(Path(cwd) / "runs", ignore_errors=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:9s} median {medians[name]:.3f} s  runs {' '.join(f'{x:.2f}' for x in t)}")
    print(f"ratio lockstep/torchrun = {medians['lockstep'] / medians['torchrun']:.2f} "
          f"(target <= 0.5; {args.runs} alternating runs, nproc {args.nproc}, {os.cpu_count()} cpus)")


if __name__ == "__main__":
    main()
