"""One 2-rank run of the GPT benchmark (started by ``benchmarks/gpt_throughput.py``).

Every implementation trains ``examples/train_gpt.py``'s GPT on the same packed stdlib bytes, with
AdamW (nanoGPT's param groups), a linear warmup + cosine lr computed per step, and clipping by the
global gradient norm (1.0):

* ``plain-ddp``: nanoGPT's loop by hand: DDP, ``clip_grad_norm_``, lr set on the param groups,
  rank 0 writes the loss to a ``SummaryWriter`` every step.
* ``plain-fsdp``: the same with ``fully_shard`` on every Block and on the root (FSDP2).
* ``trainer-ddp`` / ``trainer-fsdp`` / ``trainer-fsdp-ac``: ``lockstep.Trainer`` under the launcher
  with its defaults (run directory logging, progress bar), ``CosineAnnealingWithWarmupScheduler``,
  ``GradientClipping``, ``SpeedMonitor``, ``LRMonitor`` and a ``TensorboardLogger``; ``-ac`` adds
  activation checkpointing of every Block. FSDP runs as ``train_gpt.py`` sets it up
  (``backward_prefetch='BACKWARD_PRE'``); ``trainer-fsdp-post`` keeps the ``fsdp_config`` default,
  ``BACKWARD_POST``.

Writes ``result.json``: tokens/s (rank 0's clock between two barriers after the warm-up), model
FLOP/s per rank, peak RSS of each rank, and the bytes each rank holds in parameters, gradients and
optimizer state.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import lockstep
from lockstep import dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_gpt  # noqa: E402

LR, WARMUP_FRACTION, ALPHA_F, CLIP = 3e-3, 0.05, 0.1, 1.0


def lr_at(step: int, total: int) -> float:
    """nanoGPT-style: linear warmup from 0, then cosine down to ALPHA_F of the peak."""
    warmup = int(WARMUP_FRACTION * total)
    if step < warmup:
        return LR * step / warmup
    frac = min((step - warmup) / max(total - warmup, 1), 1.0)
    return LR * (ALPHA_F + (1 - ALPHA_F) * (1 + math.cos(math.pi * frac)) / 2)


class Clock:
    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.total, self.start, self.seconds = warmup, warmup + steps, 0.0, 0.0

    def tick(self, step: int) -> None:
        if step in (self.warmup, self.total):
            dist.barrier()
            now = time.perf_counter()
            if step == self.warmup:
                self.start = now
            else:
                self.seconds = now - self.start


def setup(args: argparse.Namespace) -> tuple[train_gpt.GPT, Any, argparse.Namespace]:
    gpt_args = train_gpt.parse_args(["--max_duration", f"{args.warmup + args.steps}ba", "--sample_bytes", "0",
                                     "--eval_interval", "1000ep", "--layers", str(args.layers), "--dim", str(args.dim),
                                     "--heads", str(args.heads)])
    torch.manual_seed(0)
    files = train_gpt.stdlib_files()
    data = train_gpt.PackedTokens(train_gpt.load_split(files, "train"), gpt_args.block_size)
    loader = train_gpt.TokenLoader(data, batch_size=gpt_args.batch_size, drop_last=True,
                                   sampler=dist.get_sampler(data, shuffle=True, seed=0, drop_last=True))
    model = train_gpt.GPT(gpt_args.layers, gpt_args.heads, gpt_args.dim, gpt_args.block_size)
    return model, loader, gpt_args


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2 and p is not model.embed.weight]
    rest = [p for p in model.parameters() if not (p.dim() >= 2 and p is not model.embed.weight)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95))


def run_plain(args: argparse.Namespace, out: Path) -> tuple[Clock, torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard
    from torch.utils.tensorboard import SummaryWriter

    model, loader, _ = setup(args)
    if args.impl == "plain-fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        module = model
    else:
        module = DistributedDataParallel(model)
    optimizer = adamw(model)  # after fully_shard: the sharded parameters
    writer = SummaryWriter(str(out / "tb")) if dist.get_global_rank() == 0 else None
    clock, total = Clock(args.warmup, args.steps), args.warmup + args.steps
    loader.sampler.set_epoch(0)
    for step, batch in enumerate(loader):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total)
        loss = model.loss(module(batch), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if writer is not None:
            writer.add_scalar("loss/train/total", loss.item(), step + 1)
        clock.tick(step + 1)
        if step + 1 == total:
            break
    if writer is not None:
        writer.close()
    return clock, model, optimizer


class Timer(lockstep.Callback):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def batch_end(self, state: Any, logger: Any) -> None:
        self.clock.tick(state.timestamp.batch)


def run_trainer(args: argparse.Namespace, out: Path) -> tuple[Clock, torch.nn.Module, torch.optim.Optimizer]:
    from lockstep.algorithms import GradientClipping
    from lockstep.callbacks import LRMonitor, SpeedMonitor
    from lockstep.loggers import TensorboardLogger
    from lockstep.optim import CosineAnnealingWithWarmupScheduler

    model, loader, _ = setup(args)
    optimizer = adamw(model)
    clock = Clock(args.warmup, args.steps)
    parallel = {}
    if args.impl.startswith("trainer-fsdp"):
        # as examples/train_gpt.py: FSDP2's own prefetch; -post is the fsdp_config default (seed 001's)
        parallel["fsdp_config"] = {"activation_checkpointing": args.impl.endswith("-ac"),
                                   "backward_prefetch": "BACKWARD_POST" if args.impl.endswith("-post") else "BACKWARD_PRE"}
    trainer = lockstep.Trainer(
        model=model, train_dataloader=loader, max_duration=f"{args.warmup + args.steps}ba", optimizers=optimizer,
        schedulers=CosineAnnealingWithWarmupScheduler(f"{WARMUP_FRACTION}dur", alpha_f=ALPHA_F),
        algorithms=[GradientClipping("norm", CLIP)], callbacks=[SpeedMonitor(window_size=20), LRMonitor(), Timer(clock)],
        loggers=[TensorboardLogger(str(out / "tb"))], device="cpu", **parallel)
    trainer.fit()
    trainer.close()
    return clock, model, optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in parameters, gradients (as if kept) and optimizer state."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    optim = sum(local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return 2 * params + optim  # a gradient per parameter during the step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", required=True,
                        choices=["plain-ddp", "plain-fsdp", "trainer-ddp", "trainer-fsdp", "trainer-fsdp-ac",
                                 "trainer-fsdp-post"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.initialize_dist("cpu")
    run = run_plain if args.impl.startswith("plain") else run_trainer
    clock, model, optimizer = run(args, args.out)
    tokens = args.steps * dist.get_world_size() * 16 * 128
    flops = model.flops_per_batch(torch.zeros(16, 129)) * args.steps / clock.seconds  # per rank
    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, state_bytes(model, optimizer)],
                        dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    torch.distributed.all_gather(every, mine)
    if dist.get_global_rank() == 0:
        (args.out / "result.json").write_text(json.dumps({
            "tokens_per_s": tokens / clock.seconds, "flops_per_s_per_rank": flops, "params": model.num_params(),
            "peak_rss_mib": [float(t[0]) for t in every], "state_mib": [float(t[1]) / 2 ** 20 for t in every]}))
    dist.barrier()
    torch.distributed.destroy_process_group()  # a process exiting with gloo's threads alive may abort


if __name__ == "__main__":
    main()
