"""DeepSpeed imported ahead of the ranks that fork from a server: by :func:`lockstep.testing.run_distributed`'s
fork server, and by the launcher's prefork server under ``LOCKSTEP_PREFORK=+deepspeed``. The ranks
then find DeepSpeed imported (~0.7 s of CPU a rank otherwise) and with it the Muon optimizer that
a ZeRO engine imports on every build and gradient reduction (~2.6 s: it compiles with
torch.compile at import). DeepSpeed comes in as the Trainer imports it (without mlflow).

Only on a CPU build of torch: DeepSpeed asks for the accelerator at import, which with CUDA would
initialise the driver in the server and leave no rank forked from it able to use the GPU. An
import that fails leaves the ranks to import DeepSpeed themselves, and to meet the error there."""

from __future__ import annotations

import contextlib
import importlib

import torch

if torch.version.cuda is None and torch.version.hip is None:
    with contextlib.suppress(Exception):
        from lockstep.parallel.deepspeed import import_deepspeed

        import_deepspeed(torch.device("cpu"))
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
