"""A training job for the fault tests, run under the launcher with autoresume.

Faults come from the command line: ``--kill A:R:B`` makes rank R SIGKILL itself after batch B on
attempt A (LOCKSTEP_RESTART_COUNT), ``--kill A:R:B:LAYOUT`` only while LAYOUT trains; ``--kill-in-save A:B`` makes rank 0 die on attempt A while
saving the checkpoint of batch B, after the file is written and before it is renamed;
``--kill-in-write A:R:B`` makes rank R die as its writer thread starts to write batch B's
checkpoint. ``--sharded`` trains under FSDP with sharded checkpoints, ``--zero N`` under DeepSpeed
ZeRO stage N (in both, every rank writes its part of each checkpoint). ``--layouts ddp,sharded,...``
trains each named layout in turn, uninterrupted, in one launch (FOLDER/LAYOUT, OUT.LAYOUT): the
references of several tests for the cost of one launch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lockstep import Callback, Trainer, dist  # noqa: E402
from lockstep.checkpoint import files, zipwriter  # noqa: E402
from tests.trainer.common import DropoutMLP, full_params, loader  # noqa: E402


def faults(specs: list[str]) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in spec.split(":")) for spec in specs]


def kills_of(specs: list[str], layout: str | None) -> set[tuple[int, int]]:
    """The (rank, batch) kills of this attempt while ``layout`` trains (None: not --layouts)."""
    attempt = int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
    kills = set()
    for spec in specs:
        a, r, b, *only = spec.split(":")
        if int(a) == attempt and (not only or only[0] == layout):
            kills.add((int(r), int(b)))
    return kills


class Faults(Callback):
    def __init__(self, kills: set[tuple[int, int]], sleep: float, progress: Path | None) -> None:
        self.kills = kills
        self.sleep, self.progress = sleep, progress

    def batch_end(self, state, logger) -> None:
        if (dist.get_global_rank(), state.timestamp.batch) in self.kills:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.progress is not None and dist.get_global_rank() == 0:
            self.progress.write_text(str(state.timestamp.batch.value))
        time.sleep(self.sleep)


def die_in_write(tags: set[str]) -> None:
    """SIGKILL this process as a writer starts on a checkpoint whose name holds one of ``tags``."""
    from lockstep.checkpoint.deepspeed import DeepSpeedLayout

    # not an import statement, which the launcher's prefork server would preload for every run of
    # this script: DCP costs it ~1 s of CPU, and only an FSDP run needs it
    ShardedLayout = importlib.import_module("lockstep.checkpoint.fsdp_states").ShardedLayout

    write_temp, write_tensors, write_captured = files.write_temp, ShardedLayout.write_tensors, \
        DeepSpeedLayout.write_captured

    def check(path: Path) -> None:
        if any(tag in path.name for tag in tags):
            os.kill(os.getpid(), signal.SIGKILL)

    def doomed_temp(content, path: Path):
        check(path)
        return write_temp(content, path)

    def doomed_tensors(temp: Path, tensors, group) -> tuple:
        check(temp)
        return write_tensors(temp, tensors, group)

    def doomed_captured(self, captured) -> None:
        check(Path(captured[0][0]).parents[1])  # .../<temporary folder>/deepspeed/<file>
        write_captured(self, captured)

    files.write_temp = doomed_temp
    ShardedLayout.write_tensors = staticmethod(doomed_tensors)
    DeepSpeedLayout.write_captured = doomed_captured


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--save-interval", default="4ba")
    p.add_argument("--out", required=True)
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--kill-in-save", action="append", default=[])
    p.add_argument("--kill-in-write", action="append", default=[])
    p.add_argument("--sharded", action="store_true")
    p.add_argument("--local", action="store_true", help="FSDP with per-rank local checkpoints")
    p.add_argument("--zero", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--load", default=None, help="load_path, for when autoresume finds nothing")
    p.add_argument("--progress", type=Path)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--direct", action="store_true",
                   help="write every tensor with O_DIRECT, as the writer does with large ones")
    p.add_argument("--layouts", default=None, help="comma-separated, of " + ", ".join(LAYOUTS))
    args = p.parse_args()
    if args.direct:
        zipwriter.DIRECT_MIN = 1
    jobs = [args] if args.layouts is None else [
        argparse.Namespace(**{**vars(args), "sharded": False, "local": False, "zero": None, **LAYOUTS[layout],
                              "layout": layout,
                              "folder": f"{args.folder}/{layout}", "out": f"{args.out}.{layout}"})
        for layout in args.layouts.split(",")]
    for one in jobs:
        train(one)


LAYOUTS = {"ddp": {}, "sharded": {"sharded": True}, "local": {"local": True}, "zero2": {"zero": 2}}


def train(args: argparse.Namespace) -> None:
    """One job: train, save, and write rank 0's final weights to ``args.out``."""
    attempt = int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
    doomed = {f"-ba{b}-" for a, b in faults(args.kill_in_save) if a == attempt}
    if doomed and dist.get_global_rank() == 0:
        def die_in_save(path: Path) -> None:
            if any(tag in path.name for tag in doomed):
                os.kill(os.getpid(), signal.SIGKILL)
        files._before_publish = die_in_save
    doomed_writes = {f"-ba{b}-" for a, r, b in faults(args.kill_in_write) if (a, r) == (attempt, dist.get_global_rank())}
    if doomed_writes:
        die_in_write(doomed_writes)

    torch.manual_seed(0)
    model = DropoutMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = loader(2, shuffle=True)
    if args.workers:
        data = DataLoader(data.dataset, batch_size=2, sampler=data.sampler, num_workers=args.workers)
    trainer = Trainer(model=model, train_dataloader=data, max_duration=f"{args.batches}ba",
                      optimizers=opt, schedulers=torch.optim.lr_scheduler.StepLR(opt, 5, 0.5),
                      progress_bar=False, seed=7, save_folder=args.folder, save_interval=args.save_interval,
                      run_name="job", autoresume=True, load_path=args.load,
                      fsdp_config={"state_dict_type": "sharded"} if args.sharded else
                      {"state_dict_type": "local"} if args.local else None,
                      deepspeed_config=None if args.zero is None else {"zero_optimization": {"stage": args.zero}},
                      callbacks=[Faults(kills_of(args.kill, getattr(args, "layout", None)), args.sleep,
                                        args.progress)])
    uploader = trainer.saver.uploader if trainer.saver is not None else None
    if uploader is not None:  # an upload process only on ranks that upload: DDP's rank 0, every rank of the rest
        folder_layout = args.sharded or args.local or args.zero is not None
        assert (uploader._writer is not None) == (folder_layout or dist.get_global_rank() == 0)
    start = trainer.state.timestamp.batch
    trainer.fit()
    weights = full_params(model)  # a collective under FSDP
    if dist.get_global_rank() == 0:
        torch.save(weights, args.out)
        print(f"attempt {attempt} resumed at batch {start}")


if __name__ == "__main__":
    main()
