"""A Trainer job for test_upload_attribution.py: ``python upload_kill_job.py BUCKET``.

Two DDP ranks save to ``s3://BUCKET/r`` every 2 batches; once batch 2's save is handed to the
background writer (BATCH_CHECKPOINT), and so before its upload is handed to the upload process,
rank 0 SIGKILLs its own upload process and waits until its uploader has seen the loss (at that
hand-over, however fast or slow the machine), so the save of batch 4 fails on every rank with
rank 0's error. Rank 0 then takes a second longer to exit than rank 1, as a rank
with more to shut down does: the launcher must still name rank 0.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lockstep import Callback, Trainer  # noqa: E402
from tests.trainer.common import MLP, loader  # noqa: E402


class KillUploads(Callback):
    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def batch_checkpoint(self, state, logger) -> None:
        if state.timestamp.batch.value != 2 or os.environ["RANK"] != "0":
            return
        assert self.trainer is not None and self.trainer.saver is not None
        uploader = self.trainer.saver.uploader
        os.kill(uploader._writer.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while uploader.state()[1] is None:
            assert time.monotonic() < deadline, "the uploader never saw its process die"
            time.sleep(0.02)
        atexit.register(time.sleep, 1.0)


def main(bucket: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    kill = KillUploads()
    trainer = Trainer(model=model, train_dataloader=loader(4),
                      optimizers=torch.optim.AdamW(model.parameters(), lr=0.01), device="cpu", progress_bar=False,
                      seed=3, max_duration="6ba", run_name="r", save_folder=f"s3://{bucket}/r", save_interval="2ba",
                      callbacks=[kill])
    kill.trainer = trainer
    trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1])
