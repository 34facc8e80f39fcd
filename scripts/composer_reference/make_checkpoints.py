"""Make checkpoints with Composer 0.32.1 itself, and record how Composer continues from them.

Runs in the reference environment (``bash scripts/composer_reference/setup.sh``), never in lockstep's:

    /tmp/composer-venv/bin/python scripts/composer_reference/make_checkpoints.py

tests/fixtures/composer/resume_classifier.py (Composer code) trains a small classifier with
dropout, DecoupledAdamW and a per-batch LambdaLR schedule on 2 CPU ranks (gloo) for 6 batches, mid-epoch, and
saves: under DDP a monolithic ``.pt``, under FSDP a sharded (torch.distributed.checkpoint) folder.
Composer's FSDP1 wrapping asks for a CUDA device, so the sharded checkpoint comes from its FSDP2
path (``FSDP_VERSION=2``), which runs on CPU. Each checkpoint is then resumed by Composer to batch
12 and the final parameters are kept. Written to tests/fixtures/composer/checkpoints/:

    monolithic.pt                   Composer's ep0-ba6-rank0.pt
    sharded/                        Composer's ep0-ba6 folder (.metadata, __0_0.distcp, __1_0.distcp)
    continued_monolithic.pt         {'params': {name: tensor}, 'batch': 12} after Composer resumed monolithic.pt
    continued_sharded.pt            the same for sharded/

With ``--this-machine`` it keeps the checkpoints and only has Composer continue them again, writing
the two ``continued_*.pt`` for machines whose floating-point results are this one's
(``tests/fixtures/numerics.py``) under ``checkpoints/numerics/<tag>/``.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "fixtures" / "composer" / "resume_classifier.py"
OUT = REPO / "tests" / "fixtures" / "composer" / "checkpoints"
sys.path.insert(0, str(REPO))
from tests.fixtures import numerics  # noqa: E402  (the repository, on the path above)


def on_two_ranks(*args: str, fsdp: bool = False) -> None:
    """Run SCRIPT with ``args`` as 2 gloo ranks, set up as torchrun would (Composer reads this environment)."""
    port = str(random.randint(20000, 40000))
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    if fsdp:
        env["FSDP_VERSION"] = "2"
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    if any(p.wait(timeout=300) for p in ranks):
        raise SystemExit(f"{SCRIPT.name} {' '.join(args)} failed")


def continue_here() -> None:
    """Composer's continuations of the checkpoints in OUT, as this machine computes them."""
    for checkpoint, flags in (("monolithic.pt", ()), ("sharded", ("sharded",))):
        out = numerics.this_machines(OUT / f"continued_{checkpoint.removesuffix('.pt')}.pt")
        out.parent.mkdir(parents=True, exist_ok=True)
        on_two_ranks("resume", str(OUT / checkpoint), str(out), *flags, fsdp=bool(flags))
        print(out.relative_to(REPO), out.stat().st_size)


def main() -> None:
    if "--this-machine" in sys.argv[1:]:
        continue_here()
        return
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        on_two_ranks("save", str(work / "ddp"))
        shutil.copy(work / "ddp" / "ep0-ba6-rank0.pt", OUT / "monolithic.pt")
        on_two_ranks("resume", str(OUT / "monolithic.pt"), str(OUT / "continued_monolithic.pt"))
        on_two_ranks("save", str(work / "fsdp"), "sharded", fsdp=True)
        shutil.copytree(work / "fsdp" / "ep0-ba6", OUT / "sharded")
        on_two_ranks("resume", str(OUT / "sharded"), str(OUT / "continued_sharded.pt"), "sharded", fsdp=True)
    for path in sorted(OUT.rglob("*")):
        print(path.relative_to(REPO), path.stat().st_size)


if __name__ == "__main__":
    main()
