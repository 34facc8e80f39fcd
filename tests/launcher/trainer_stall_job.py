"""A Trainer job for the stall tests of test_trainer_stalls.py: ``python trainer_stall_job.py FOLDER``.

It saves a checkpoint after every batch. With STOP_RANK set, that rank stops for good after
batch 3, just before the save (the others wait for it in the save's agreement); with SLOW_WRITE
set, each of rank 0's checkpoint writes takes that many seconds, and it trains 3 batches, not 6:
the next save waits for each write but the last, which the others wait for. With LOAD set, it
loads that checkpoint and trains on to batch 8; STOP_IN_LOAD: rank 1 then stops for good on its
way into the load. STOP_IN_EVAL: it evaluates after batch 2, and rank 1
stops for good after its first eval batch. SLOW_FIT_END: rank 0's FIT_END takes that many seconds (as
drawing a loss curve or exporting a model may).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lockstep import Callback, Trainer, dist  # noqa: E402
from lockstep.checkpoint import files  # noqa: E402
from tests.trainer.common import MLP, loader  # noqa: E402


class StopInEval(Callback):
    def eval_batch_end(self, state, logger) -> None:
        if dist.get_global_rank() == 1:
            print("rank 1 stops in the evaluation", flush=True)
            while True:
                time.sleep(0.05)


class SlowFitEnd(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def fit_end(self, state, logger) -> None:
        if dist.get_global_rank() == 0:
            time.sleep(self.seconds)


class StopAfter(Callback):
    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch = rank, batch

    def batch_end(self, state, logger) -> None:
        if dist.get_global_rank() == self.rank and state.timestamp.batch == self.batch:
            print(f"rank {self.rank} stops after batch {self.batch}", flush=True)
            while True:
                time.sleep(0.05)


def slow(write, seconds: float):
    def slow_write(*args, **kwargs):
        time.sleep(seconds)
        return write(*args, **kwargs)
    return slow_write


def stop_first(probe):
    def stopped(*args, **kwargs):
        print("rank 1 stops on its way into the load", flush=True)
        while True:
            time.sleep(0.05)
    return stopped


def main() -> None:
    callbacks = [StopAfter(int(os.environ["STOP_RANK"]), 3)] if "STOP_RANK" in os.environ else []
    if "SLOW_FIT_END" in os.environ:
        callbacks.append(SlowFitEnd(float(os.environ["SLOW_FIT_END"])))
    evaluation = {}
    if "STOP_IN_EVAL" in os.environ:
        callbacks.append(StopInEval())
        evaluation = {"eval_dataloader": loader(2, n=16), "eval_interval": "2ba"}
    if "STOP_IN_LOAD" in os.environ and dist.get_global_rank() == 1:
        loading = importlib.import_module("lockstep.checkpoint.loader")  # the package's `loader` is a function
        loading._probe = stop_first(loading._probe)
    if "SLOW_WRITE" in os.environ:
        files.write_temp = slow(files.write_temp, float(os.environ["SLOW_WRITE"]))
    model, load = MLP(), os.environ.get("LOAD")
    duration = "8ba" if load else "3ba" if "SLOW_WRITE" in os.environ else "6ba"
    trainer = Trainer(model=model, train_dataloader=loader(2, n=48), max_duration=duration,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1), progress_bar=False,
                      device="cpu", save_folder=sys.argv[1], save_interval="1ba", save_num_checkpoints_to_keep=2,
                      load_path=load, callbacks=callbacks, **evaluation)
    trainer.fit()
    print(f"rank {dist.get_global_rank()} finished", flush=True)


if __name__ == "__main__":
    main()
