"""The job of the kill -9 test in test_resume_world_sizes.py, run under the launcher: DDP with
autoresume; ``python resume_job.py FOLDER OUT [B [CLEAN]]``: on the first attempt rank 3 SIGKILLs
itself after batch B; with CLEAN, the first attempt first trains the same job uninterrupted (saving
to FOLDER-clean) and writes its parameters to CLEAN, so that one launch gives the test both runs."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lockstep import Callback, dist  # noqa: E402
from tests.trainer.test_resume_world_sizes import fit  # noqa: E402


class Kill(Callback):
    def __init__(self, after: int | None) -> None:
        self.attempt = int(os.environ.get("LOCKSTEP_RESTART_COUNT", "0"))
        self.after = after

    def fit_start(self, state, logger) -> None:
        if dist.get_global_rank() == 0:
            print(f"attempt {self.attempt} resumed at batch {state.timestamp.batch}", flush=True)

    def batch_end(self, state, logger) -> None:
        if (self.attempt, dist.get_global_rank(), state.timestamp.batch) == (0, 3, self.after):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    folder, out = sys.argv[1], sys.argv[2]
    kill = Kill(int(sys.argv[3]) if len(sys.argv) > 3 else None)
    if len(sys.argv) > 4 and kill.attempt == 0:
        clean = fit("ddp", "6ba", f"{folder}-clean", save_interval="2ba", run_name="ws4", autoresume=True,
                    callbacks=[Kill(None)])
        if dist.get_global_rank() == 0:
            torch.save(clean, sys.argv[4])
    params = fit("ddp", "6ba", folder, save_interval="2ba", run_name="ws4", autoresume=True, callbacks=[kill])
    if dist.get_global_rank() == 0:
        torch.save(params, out)


if __name__ == "__main__":
    main()
