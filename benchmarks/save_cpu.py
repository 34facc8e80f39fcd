"""CPU time of one checkpoint write: lockstep's background writer against ``torch.save``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/save_cpu.py            # about 1 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/save_cpu.py --width 512 --rounds 15

One process, no training: the state of ``trainer_throughput.py``'s ``big`` workload (an MLP of
4 x Linear(2048) with AdamW after one step, about 200 MB), written into a folder beside the
checkout (not /tmp, which may be tmpfs). On a machine whose cores all train, the CPU that a
background write takes is CPU that the steps lose, so this is the figure to keep small; a timed
training run on a shared machine varies too much to show it. Sides, alternating, medians over
rounds of wall and CPU time (of the calling thread, kernel time included):

* ``stage``: the copy that training waits for before the writer thread takes over
  (``staging.Stager``, buffers kept from the previous round as in training).
* ``lockstep write``: what the writer thread does with that copy: ``files.write_temp`` and
  ``files.publish`` (fsync, rename, fsync of the folder), then the previous file deleted.
* ``torch.save``: the same copy with ``torch.save`` to a new file, then the previous one deleted.
* ``torch.save + fsync``: and an fsync, the durability lockstep's write includes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lockstep.checkpoint import files, staging

HERE = Path(__file__).resolve().parent


def build_state(width: int) -> dict:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(3)] + [torch.nn.Linear(width, 10)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return 1000 * (time.perf_counter() - wall), 1000 * (time.thread_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = build_state(args.width)
    stager = staging.Stager()
    folder = Path(tempfile.mkdtemp(prefix=".save-cpu-", dir=HERE))
    previous: list[Path] = []

    def rotate(path: Path) -> None:
        for old in previous:
            files.remove(old)
        previous[:] = [path]

    def ours(n: int) -> None:
        path = folder / f"ours-{n}.pt"
        files.publish(files.write_temp(staged, path), path)
        rotate(path)

    def plain(n: int, fsync: bool) -> None:
        path = folder / f"plain-{n}.pt"
        torch.save(staged, str(path))
        if fsync:
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        rotate(path)

    sides = {"lockstep write": ours, "torch.save": lambda n: plain(n, False),
             "torch.save + fsync": lambda n: plain(n, True)}
    results: dict[str, list[tuple[float, float]]] = {"stage": [], **{name: [] for name in sides}}
    try:
        for n in range(args.rounds):
            results["stage"].append(timed(lambda: stager.stage(state)))
            staged = stager.stage(state)
            names = list(sides)
            for name in names[n % len(names):] + names[:n % len(names)]:
                results[name].append(timed(lambda: sides[name](n)))
    finally:
        files.remove(folder)
    size = staging.storage_bytes(state) / 1e6
    print(f"one checkpoint of {size:.0f} MB (MLP 4 x {args.width}, AdamW), {args.rounds} rounds, "
          f"{time.strftime('%Y-%m-%d')}; medians")
    print(f"{'':22s} {'wall ms':>8s} {'CPU ms':>8s}")
    for name, values in results.items():
        print(f"{name:22s} {statistics.median(w for w, _ in values):8.1f} {statistics.median(c for _, c in values):8.1f}")


if __name__ == "__main__":
    main()
