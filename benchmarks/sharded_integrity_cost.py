"""What recording and checking the CRC32 of a sharded checkpoint's files costs, against DCP itself.

Run it with the launcher (2 ranks, gloo, one thread per rank); rank 0 prints the table:

    OMP_NUM_THREADS=1 .venv/bin/lockstep -n 2 benchmarks/sharded_integrity_cost.py

Options: ``--rounds 9``, ``--width 512 --layers 4`` (the model; the default is about 1M parameters, so
about 12 MB of parameters and AdamW state across the ranks, 6 MB a rank).

Each round, alternating which goes first, medians over rounds, rank 0's clock, into a new folder:

* save, DCP: ``dcp.save`` with ``FileSystemWriter(sync_files=True)``, as the saver used before.
* save, lockstep: ``ShardedLayout.write_parts``: the same save through the writer that records each
  file's size and CRC32, and the all-gather of every rank's records (this runs in the background
  writer thread, not in the training step).
* load, DCP: ``dcp.load`` of that folder into the live model and optimizer state.
* load check: ``integrity.check_sharded``: every rank stats every file and checks the CRC32 of its
  share; the loader runs it before ``dcp.load``, so a load costs the sum.

The files were just written, so they are read from the page cache, as they are by a restart on the
same machine; from a cold disk the check reads each byte once and DCP's load then finds it cached.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard

from lockstep import dist
from lockstep.checkpoint import integrity
from lockstep.checkpoint.fsdp_states import ShardedLayout


def _model(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()  # both moment buffers exist
    return model, optimizer


def _timed(fn) -> float:
    dist.barrier()
    began = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - began


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    dist.initialize_dist("cpu")
    torch.set_num_threads(1)
    model, optimizer = _model(args.width, args.layers)
    layout = ShardedLayout(model, [optimizer])
    group = torch.distributed.new_group(backend="gloo")
    root = [tempfile.mkdtemp(prefix="lockstep-integrity-") if dist.get_global_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    base = Path(root[0])
    times: dict[str, list[float]] = {k: [] for k in ("save, DCP", "save, lockstep", "load, DCP", "load check")}
    nbytes = 0
    for r in range(args.rounds):
        tensors, _ = layout.folder_parts(base, *layout.gather())
        plain, ours = base / f"plain{r}", base / f"ours{r}"
        saves = [("save, DCP", lambda: dcp.save(tensors, storage_writer=dcp.FileSystemWriter(plain, sync_files=True),
                                                 process_group=group)),
                 ("save, lockstep", lambda: layout.write_parts(ours, tensors, group))]
        for name, fn in saves if r % 2 == 0 else saves[::-1]:
            times[name].append(_timed(fn))
        parts = {**layout._parts, **integrity.record(ours, [integrity.DCP_METADATA])}
        nbytes = sum(size for size, _ in parts.values())
        rank, world = dist.get_global_rank(), dist.get_world_size()
        live, _ = layout.folder_parts(base, *layout.gather())
        loads = [("load, DCP", lambda: dcp.load(live, storage_reader=dcp.FileSystemReader(ours))),
                 ("load check", lambda: integrity.check_sharded(ours, {"parts": parts}, (rank, world)))]
        for name, fn in loads if r % 2 == 0 else loads[::-1]:
            times[name].append(_timed(fn))
    if dist.get_global_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {nbytes / 1e6:.1f} MB in {len(parts)} files, "
              f"medians of {args.rounds} rounds:")
        for name, values in times.items():
            print(f"  {name:15s} {statistics.median(values) * 1e3:8.2f} ms")
        save_cost = statistics.median(b - a for a, b in zip(times["save, DCP"], times["save, lockstep"]))
        print(f"  recording adds {save_cost * 1e3:.2f} ms to a save (in the writer thread); the check adds "
              f"{statistics.median(times['load check']) * 1e3:.2f} ms to a load")
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
