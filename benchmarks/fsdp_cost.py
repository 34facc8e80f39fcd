"""FSDP FULL_SHARD against DDP: per-rank memory of the training state, and steps/s.

Run it with the launcher (2 ranks, gloo, one thread per rank); rank 0 prints the results:

    OMP_NUM_THREADS=1 .venv/bin/lockstep -n 2 benchmarks/fsdp_cost.py

Options: ``--rounds 5 --warmup 10 --steps 60`` (speed), ``--layers 12 --width 2048`` (memory).

* Memory: a stack of ``--layers`` ``nn.Linear(width, width)`` (12 x 2048 = 50.4M parameters), AdamW,
  one training step through the Trainer, each layer its own FSDP unit. Per rank it counts the bytes
  this rank holds of parameters, gradients and optimizer state (a sharded tensor counts its local
  shard): what the target ``FULL_SHARD <= 0.55 x DDP`` is about. Parameters gathered for a
  layer's forward/backward are freed after it, so they are not part of the steady state.
* Speed: the Trainer benchmark's MLP (4 x ``nn.Linear``, 512 wide), 64 samples per rank per step,
  AdamW; DDP, FULL_SHARD with each Linear a unit, FULL_SHARD with the whole model one unit, and a
  hand-written ``fully_shard`` loop (each Linear a unit, no Trainer) take turns going first in each
  round; it prints the median steps/s of each over the rounds and the median of the within-round
  ratios to DDP. The Trainer's FULL_SHARD against the plain loop is lockstep's own cost; both
  against DDP is what sharding costs on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep import dist


class Stack(lockstep.Model):
    def __init__(self, layers: int, width: int, classes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(width, classes))

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch[1])

    wrap_layers = True

    def fsdp_wrap_fn(self, module: nn.Module) -> bool:
        return self.wrap_layers and isinstance(module, nn.Linear)


def _loader(width: int, classes: int, batch: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    n = batch * steps * dist.get_world_size()
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g))
    return DataLoader(data, batch_size=batch, sampler=dist.get_sampler(data, shuffle=False))


def _trainer(model: Stack, loader: DataLoader, duration: str, fsdp: bool) -> lockstep.Trainer:
    return lockstep.Trainer(model=model, train_dataloader=loader, max_duration=duration,
                            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-4), progress_bar=False,
                            fsdp_config={"sharding_strategy": "FULL_SHARD"} if fsdp else None)


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(trainer: lockstep.Trainer) -> dict[str, int]:
    model = trainer.state.model
    optimizer = trainer.state.optimizers[0]
    params = [p for p in model.parameters()]
    return {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
    }


def memory(layers: int, width: int) -> dict[str, dict[str, int]]:
    out = {}
    for name, fsdp in (("DDP", False), ("FULL_SHARD", True)):
        model = Stack(layers, width, 10)
        trainer = _trainer(model, _loader(width, 10, 4, 1), "1ba", fsdp)
        trainer.fit()
        # the Trainer frees gradients after the step (zero_grad(set_to_none=True)): count them as
        # the backward leaves them, by running one more backward without a step
        batch = next(iter(trainer.train_dataloader))
        model.loss(model(batch), batch).backward()
        out[name] = state_bytes(trainer)
        del trainer, model
    return out


SPEED_SIDES = ("DDP", "FULL_SHARD", "FULL_SHARD, one unit", "plain fully_shard loop")


def timed_rounds(sides: tuple[str, ...], make: Callable[[str, str], Any], rounds: int, warmup: int,
                 steps: int) -> list[dict[str, float]]:
    """Steps/s of each side per round; ``make(side, duration)`` builds a Trainer of ``warmup + steps``
    batches. Sides take turns going first; each is timed after ``warmup`` steps."""
    results = []
    for r in range(rounds):
        row = {}
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            trainer = make(side, f"{warmup}ba")
            trainer.fit()
            trainer.state.max_duration = lockstep.Time.from_input(f"{warmup + steps}ba")
            dist.barrier()
            start = time.perf_counter()
            trainer.fit()
            dist.barrier()
            row[side] = steps / (time.perf_counter() - start)
            del trainer
        results.append(row)
    return results


class PlainFSDP:
    """A hand-written FSDP2 loop beside the Trainer: ``fully_shard`` on each Linear and on the
    model, AdamW, the same data. ``fit()`` trains up to ``state.max_duration`` batches, as the
    Trainer does, so that :func:`timed_rounds` times both alike."""

    def __init__(self, duration: str, batches: int) -> None:
        from torch.distributed.fsdp import fully_shard

        self.model = Stack(3, 512, 10)
        for module in self.model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batches = iter(_loader(512, 10, 64, batches))
        self.state = argparse.Namespace(max_duration=lockstep.Time.from_input(duration))
        self.done = 0

    def fit(self) -> None:
        while self.done < self.state.max_duration.value:
            batch = next(self.batches)
            self.model.loss(self.model(batch), batch).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.done += 1


def speed(rounds: int, warmup: int, steps: int) -> list[dict[str, float]]:
    def make(side: str, duration: str) -> lockstep.Trainer | PlainFSDP:
        if side == "plain fully_shard loop":
            return PlainFSDP(duration, warmup + steps)
        model = Stack(3, 512, 10)
        model.wrap_layers = side == "FULL_SHARD"
        return _trainer(model, _loader(512, 10, 64, warmup + steps), duration, side != "DDP")

    return timed_rounds(SPEED_SIDES, make, rounds, warmup, steps)


def setup(layers: int, width: int) -> argparse.Namespace:
    """The command line of this benchmark and the DeepSpeed one (their memory model's size differs),
    and the same process settings for every side."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--width", type=int, default=width)
    args = parser.parse_args()
    os.environ.pop("LOCKSTEP_RUN_DIRECTORY", None)  # no file loggers on either side
    torch.set_num_threads(1)
    return args


def print_speed(runs: list[dict[str, float]], sides: tuple[str, ...], title: str) -> None:
    """Steps/s per side (median over rounds) and its ratio to DDP, the first side."""
    ddp = statistics.median(r["DDP"] for r in runs)
    print(title)
    print(f"  DDP {ddp:.1f} steps/s")
    for name in sides[1:]:
        value = statistics.median(r[name] for r in runs)
        pairwise = statistics.median(r[name] / r["DDP"] for r in runs)
        print(f"  {name} {value:.1f} steps/s, ratio {value / ddp:.3f} (pairwise median {pairwise:.3f})")


def main() -> None:
    args = setup(layers=12, width=2048)
    mem = memory(args.layers, args.width)
    runs = speed(args.rounds, args.warmup, args.steps)
    if dist.get_global_rank() != 0:
        return
    n = sum(p.numel() for p in Stack(args.layers, args.width, 10).parameters())
    print(f"world size {dist.get_world_size()}, memory model {n / 1e6:.1f}M parameters (AdamW), per rank:")
    for name, parts in mem.items():
        total = sum(parts.values())
        detail = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items())
        print(f"  {name:<10} {total / 2**20:8.1f} MiB  ({detail})")
    ratio = sum(mem["FULL_SHARD"].values()) / sum(mem["DDP"].values())
    print(f"  FULL_SHARD / DDP = {ratio:.3f}")
    print_speed(runs, SPEED_SIDES, f"speed, benchmark MLP (4 x 512), 64 samples/rank/step, {args.rounds} rounds x "
                                   f"{args.steps} steps:")
    own = statistics.median(r["FULL_SHARD"] / r["plain fully_shard loop"] for r in runs)
    print(f"  Trainer FULL_SHARD / plain fully_shard loop: pairwise median {own:.3f}")


if __name__ == "__main__":
    main()
