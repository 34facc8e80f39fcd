"""The Trainer on Composer's meshes against a hand-written loop over the same mesh: tokens/s.

Run it with the launcher on 4 ranks (gloo, one thread per rank); rank 0 prints the results:

    OMP_NUM_THREADS=1 .venv/bin/lockstep -n 4 benchmarks/mesh_throughput.py

Options: ``--rounds 5 --warmup 5 --steps 30``, ``--layers 2 --dim 128 --block_size 64 --batch_size 8``.

The model is the GPT example's (``examples/train_gpt.py``), on random tokens, AdamW, no clipping.
Two meshes, each run both ways, taking turns going first in each round:

* HSDP 2 x 2: ``fsdp_config={'data_parallel_replicate_degree': 2}`` against ``fully_shard`` of each
  Block and of the model over a (replicate 2, shard 2) mesh;
* FSDP + TP 2 x 2: ``parallelism_config={'fsdp': {}, 'tp': {...}}`` (each Block's MLP split,
  Megatron's way) against ``parallelize_module`` then ``fully_shard`` over a (shard 2, tensor 2)
  mesh, torchtitan's shape. The ranks of a tensor-parallel pair train on one batch of twice the size.

It prints the median tokens/s of each side and the median of the within-round ratios Trainer / loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset

import lockstep
from lockstep import dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from fsdp_cost import PlainFSDP, timed_rounds  # noqa: E402  (benchmarks/ is this script's folder)
from train_gpt import GPT  # noqa: E402

PLAN = {"blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}
MESHES = {"HSDP 2 x 2": ((2, 2), ("data_parallel_replicate", "data_parallel_shard"), 1),
          "FSDP + TP 2 x 2": ((2, 2), ("data_parallel_shard", "tensor_parallel"), 2)}


class RandomTokens(Dataset):
    def __init__(self, n: int, block_size: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, block_size + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(args.layers, 4, args.dim, args.block_size, 256)


def _loader(args: argparse.Namespace, tp: int, batches: int, data_rank: int, data_size: int) -> DataLoader:
    batch = args.batch_size * tp  # a tensor-parallel group trains on its ranks' share together
    dataset = RandomTokens(batch * data_size * batches, args.block_size, 256)
    return DataLoader(dataset, batch_size=batch, sampler=dist.get_sampler(dataset, num_replicas=data_size,
                                                                          rank=data_rank))


def _trainer(args: argparse.Namespace, mesh: str, duration: str, batches: int) -> lockstep.Trainer:
    _, _, tp = MESHES[mesh]
    model = _model(args)
    fsdp: dict[str, Any] = {"backward_prefetch": "BACKWARD_PRE"}
    if tp == 1:
        parallel: dict[str, Any] = {"fsdp_config": {**fsdp, "data_parallel_replicate_degree": 2}}
    else:
        parallel = {"parallelism_config": {"fsdp": fsdp, "tp": {"tensor_parallel_degree": tp, "layer_plan": PLAN}}}
    rank, world = dist.get_global_rank(), dist.get_world_size()
    return lockstep.Trainer(model=model, train_dataloader=_loader(args, tp, batches, rank // tp, world // tp),
                            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-4), max_duration=duration,
                            device="cpu", progress_bar=False, log_to_console=False, **parallel)


class PlainLoop(PlainFSDP):
    """``parallelize_module`` (with tensor parallelism), ``fully_shard`` of each Block and of the
    model over the same mesh, AdamW, the same data; ``fit()`` (fsdp_cost's loop) trains up to
    ``state.max_duration`` batches, as the Trainer does."""

    def __init__(self, args: argparse.Namespace, mesh: str, duration: str, batches: int) -> None:
        shape, names, tp = MESHES[mesh]
        device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        self.model = _model(args)
        if tp > 1:
            parallelize_module(self.model, device_mesh["tensor_parallel"], PLAN)
        data_mesh = device_mesh["data_parallel_shard"] if tp > 1 else device_mesh
        for block in self.model.blocks:
            fully_shard(block, mesh=data_mesh)
        fully_shard(self.model, mesh=data_mesh, reshard_after_forward=False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        rank, world = dist.get_global_rank(), dist.get_world_size()
        self.batches = iter(_loader(args, tp, batches, rank // tp, world // tp))
        self.state = argparse.Namespace(max_duration=lockstep.Time.from_input(duration))
        self.done = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("rounds", 5), ("warmup", 5), ("steps", 30), ("layers", 2), ("dim", 128),
                          ("block_size", 64), ("batch_size", 8)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    os.environ.pop("LOCKSTEP_RUN_DIRECTORY", None)  # no file loggers on either side
    torch.set_num_threads(1)
    dist.initialize_dist("cpu")
    if dist.get_world_size() != 4:
        sys.exit("mesh_throughput.py: run it on 4 ranks (lockstep -n 4)")
    tokens = args.batch_size * dist.get_world_size() * args.block_size  # per step, both meshes
    lines = [f"{args.layers} layers x {args.dim} wide, {tokens} tokens per step, 4 ranks, median of {args.rounds}:"]
    for mesh in MESHES:
        def make(side: str, duration: str, mesh: str = mesh) -> Any:
            batches = args.warmup + args.steps
            return _trainer(args, mesh, duration, batches) if side == "Trainer" else \
                PlainLoop(args, mesh, duration, batches)

        runs = timed_rounds(("Trainer", "loop"), make, args.rounds, args.warmup, args.steps)
        trainer = statistics.median(r["Trainer"] for r in runs) * tokens
        loop = statistics.median(r["loop"] for r in runs) * tokens
        ratio = statistics.median(r["Trainer"] / r["loop"] for r in runs)
        lines.append(f"  {mesh}: Trainer {trainer:,.0f} tokens/s, hand-written loop {loop:,.0f} tokens/s, "
                     f"ratio {ratio:.3f}")
    if dist.get_global_rank() == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
