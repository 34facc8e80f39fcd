"""A lost node's launcher started again: what it costs the elastic job to let its ranks back in.

    .venv/bin/python benchmarks/elastic_rejoin.py --trials 20
    LOCKSTEP_PREFORK=+deepspeed .venv/bin/python benchmarks/elastic_rejoin.py --trials 20 --fsdp [sharded] | --zero 2

Each trial runs tests/elastic/elastic_job.py on two launchers of 2 ranks (``--nnodes 1:2``, two
nodes on this machine), SIGKILLs node 1's launcher at a random moment (0 to 0.6 s after the first
batch ended; its ranks die with it), and starts a new node 1 launcher as soon as the two ranks
left go on. Those wait after batch 5 until the node joins (``--hold 5``), so that the join falls
inside the run whatever the machine's speed. It reports per trial, and as medians:

* **start to step**: seconds from the new launcher's start to the first batch its ranks finish
  (their start, their readiness, the master's letting them in, the new process group, the
  peer's state);
* **stall**: seconds the ranks that train lose to the join: from their noticing the new
  generation to the new group's first step being ready (``RanksChanged.seconds`` on rank 0);
* **again**: finished batches trained again because of the join (its change record's
  ``trained_again``; 0 expected).

With ``--fsdp`` or ``--zero STAGE`` the job trains with sharded state and saves every 2 batches;
node 1 is killed once the first checkpoint is published. The ranks that join take the state from
the ranks that trained when none was lost since (``again`` 0); before lockstep did that, every rank
went back to the newest checkpoint (run this file with ``PYTHONPATH`` at an older tree's ``src`` to
compare).

Every run must end with exit code 0 on both nodes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elastic_recovery import _free_port, _sharded, _start, await_file, ends_of  # noqa: E402


def trial(delay: float, out: Path, extra: list[str]) -> tuple[float, float, int]:
    """Start to step, stall and batches again, for one kill ``delay`` s after the first batch."""
    port = str(_free_port())
    node = ["--nproc-per-node", "2", "--master_addr", "127.0.0.1", "--master_port", port, "--rdzv_timeout", "60",
            "--nnodes", "1:2"]
    extra = ["--hold", "5", *extra]
    procs = [_start("elastic", out, [*node, "--node_rank", str(n)], f"run{n}", extra=extra) for n in (0, 1)]
    await_file(out / "saves" / "latest-rank0.pt" if _sharded(extra) else out / "ends0", procs)
    time.sleep(delay)
    procs[1].kill()
    procs[1].communicate()
    await_file(out / "changes0", procs[:1])
    started = time.time()
    procs[1] = _start("elastic", out, [*node, "--node_rank", "1"], "run1-again", extra=extra)
    err = ""
    for proc in procs:
        err += proc.communicate(timeout=300)[1]
        if proc.returncode != 0:
            raise RuntimeError(err)
    first = min(t for log in ("ends2", "ends3") for b, t in ends_of(out / log) if t > started)
    joined = [json.loads(line) for line in (out / "changes0").read_text().splitlines()][-1]
    return first - started, joined["seconds"], joined["trained_again"]  # the join's, not the loss's


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--fsdp", nargs="?", const="full", default=None,
                        help="train under FSDP, saving checkpoints of this state_dict_type (full) every 2 batches")
    parser.add_argument("--zero", type=int, default=None, help="train under DeepSpeed at this ZeRO stage, saving "
                                                                 "every 2 batches")
    args = parser.parse_args()
    extra = ["--fsdp", args.fsdp] if args.fsdp else ["--zero", str(args.zero)] if args.zero is not None else []
    rows = []
    for n in range(args.trials):
        delay = random.uniform(0.0, 0.6)
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(trial(delay, Path(tmp), extra))
        start, stall, again = rows[-1]
        print(f"trial {n + 1}: node 1 killed at {delay:.2f} s: start to step {start:.2f} s, stall {stall:.2f} s, "
              f"{again} batch(es) again", flush=True)
    for i, name in enumerate(("start to step (s)", "stall (s)", "batches again")):
        values = [row[i] for row in rows]
        print(f"{name}: median {statistics.median(values):.2f}, max {max(values):.2f}")


if __name__ == "__main__":
    main()
