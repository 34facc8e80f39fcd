"""Whole-process wall and CPU time of `lockstep -n N probe.py` vs `torchrun --nproc_per_node N probe.py`.

Runs lockstep (ranks forked from its prefork server, and with ``LOCKSTEP_PREFORK=0`` fresh
interpreters) and torchrun in turn, so all see the same machine load, and reports medians and
ratios. CPU time is the user and system time of the whole process tree (what a busy machine, or a
test suite, pays for each launch):

    .venv/bin/python benchmarks/launcher_overhead.py --runs 7 --nproc 4
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = Path(__file__).with_name("probe.py")


def timed(cmd: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and every descendant it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--script", default=str(PROBE), help="what each rank runs (default: probe.py)")
    args = parser.parse_args()
    bindir = Path(sys.executable).parent
    lockstep = [str(bindir / "lockstep"), "-n", str(args.nproc), args.script]
    commands = {
        "lockstep": (lockstep, {}),
        "fresh": (lockstep, {"LOCKSTEP_PREFORK": "0"}),
        "torchrun": ([str(bindir / "torchrun"), "--nproc_per_node", str(args.nproc), args.script], {}),
    }
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    with tempfile.TemporaryDirectory() as cwd:
        for cmd, env in commands.values():  # warm the page cache for every one
            timed(cmd, cwd, env)
        for _ in range(args.runs):
            for name, (cmd, env) in commands.items():
                wall, cpu = timed(cmd, cwd, env)
                walls[name].append(wall)
                cpus[name].append(cpu)
        shutil.rmtree(Path(cwd) / "runs", ignore_errors=True)
    wall = {name: statistics.median(t) for name, t in walls.items()}
    cpu = {name: statistics.median(t) for name, t in cpus.items()}
    for name in commands:
        print(f"{name:9s} wall median {wall[name]:.3f} s, CPU median {cpu[name]:.2f} s  "
              f"(walls {' '.join(f'{x:.2f}' for x in walls[name])})")
    print(f"lockstep/torchrun: wall {wall['lockstep'] / wall['torchrun']:.2f} (target <= 0.5), "
          f"CPU {cpu['lockstep'] / cpu['torchrun']:.2f}; fresh interpreters (LOCKSTEP_PREFORK=0)/torchrun: "
          f"wall {wall['fresh'] / wall['torchrun']:.2f}, CPU {cpu['fresh'] / cpu['torchrun']:.2f} "
          f"({args.runs} runs each in turn, nproc {args.nproc}, {os.cpu_count()} cpus)")


if __name__ == "__main__":
    main()
