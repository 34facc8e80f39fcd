"""DeepSpeed ZeRO stages 1, 2 and 3 against DDP: per-rank bytes of model + optimizer state, and steps/s.

Run it with the launcher (2 ranks, gloo, one thread per rank); rank 0 prints the results:

    OMP_NUM_THREADS=1 .venv/bin/lockstep -n 2 benchmarks/deepspeed_cost.py

Options: ``--rounds 5 --warmup 10 --steps 60`` (speed), ``--layers 3 --width 512`` (the model).

Both parts use the benchmark MLP (``--layers`` x ``nn.Linear(width, width)`` and a head), AdamW,
64 samples per rank per step, in fp32, through the Trainer.

* Bytes: after a step, per rank, the storage this rank holds for the model's parameters (a ZeRO-3
  rank holds its partition), the fp32 master copies DeepSpeed's optimizer keeps, and the optimizer
  state, each storage counted once. Gradients (freed after every step on all sides) and
  communication buckets are not counted: DeepSpeed's are sized by its config (ZeRO-3 reserves a
  ``reduce_bucket_size`` buffer of 5e8 elements by default, most of it never touched on a small
  model, so never resident).
* Speed: DDP and the three stages take turns going first in each round; it prints the median
  steps/s of each over the rounds and the median of the within-round ratios to DDP.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

import torch

import lockstep
from lockstep import dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_cost import Stack, _loader, print_speed, setup, timed_rounds  # noqa: E402  (the FSDP benchmark's)

SIDES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def _trainer(model: Stack, loader: Any, duration: str, side: str) -> lockstep.Trainer:
    config = None if side == "DDP" else {"zero_optimization": {"stage": int(side[-1])}}
    return lockstep.Trainer(model=model, train_dataloader=loader, max_duration=duration,
                            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-4), progress_bar=False,
                            deepspeed_config=config)


def _storages(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not yet in ``seen`` (meta tensors hold none)."""
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def state_bytes(trainer: lockstep.Trainer) -> dict[str, int]:
    model, seen = trainer.state.model, set()
    held = []
    for p in model.parameters():
        held.append(p.data)
        held.append(getattr(p, "ds_tensor", None))  # a ZeRO-3 partition
    out = {"parameters": _storages(held, seen)}
    engine = trainer._engine
    outer = trainer.state.optimizers[0] if engine is None else engine.optimizer
    inner = getattr(outer, "optimizer", outer)
    # ZeRO-1/2 and ZeRO-3 name their fp32 partitions differently; ZeRO-3 empties the inner
    # optimizer's param_groups between steps.
    masters = list(getattr(outer, "single_partition_of_fp32_groups", None)
                   or getattr(outer, "fp32_partitioned_groups_flat", None)
                   or [p for g in inner.param_groups for p in g["params"]])
    out["fp32 masters"] = _storages(masters, seen)
    out["optimizer state"] = _storages((v for s in inner.state.values() for v in s.values()
                                        if isinstance(v, torch.Tensor)), seen)
    return out


def memory(layers: int, width: int) -> dict[str, dict[str, int]]:
    out = {}
    for side in SIDES:
        model = Stack(layers, width, 10)
        trainer = _trainer(model, _loader(width, 10, 64, 1), "1ba", side)
        trainer.fit()
        out[side] = state_bytes(trainer)
        del trainer, model
    return out


def speed(rounds: int, warmup: int, steps: int, layers: int, width: int) -> list[dict[str, float]]:
    def make(side: str, duration: str) -> lockstep.Trainer:
        return _trainer(Stack(layers, width, 10), _loader(width, 10, 64, warmup + steps), duration, side)

    return timed_rounds(SIDES, make, rounds, warmup, steps)


def main() -> None:
    args = setup(layers=3, width=512)
    mem = memory(args.layers, args.width)
    runs = speed(args.rounds, args.warmup, args.steps, args.layers, args.width)
    if dist.get_global_rank() != 0:
        return
    n = sum(p.numel() for p in Stack(args.layers, args.width, 10).parameters())
    print(f"world size {dist.get_world_size()}, benchmark MLP {n / 1e6:.2f}M parameters, AdamW, fp32")
    print("model + optimizer state per rank:")
    ddp_state = None
    for side, parts in mem.items():
        state = sum(parts.values())
        ddp_state = ddp_state or state
        detail = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in parts.items())
        print(f"  {side:<7} {state / 2**20:7.2f} MiB  ratio {state / ddp_state:.3f}  ({detail} MiB)")
    print_speed(runs, SIDES, f"speed, 64 samples/rank/step, {args.rounds} rounds x {args.steps} steps:")


if __name__ == "__main__":
    main()
