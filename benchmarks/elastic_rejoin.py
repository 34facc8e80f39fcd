"""A lost node's launcher started again: what it costs the elastic job to let its ranks back in.

    .venv/bin/python benchmarks/elastic_rejoin.py --trials 20

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
* **again**: batches trained again (a finished one trained twice; 0 expected).

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

from elastic_recovery import _free_port, _start, await_file, ends_of  # noqa: E402


def trial(delay: float, out: Path) -> tuple[float, float, int]:
    """Start to step, stall and batches again, for one kill ``delay`` s after the first batch."""
    port = str(_free_port())
    node = ["--nproc-per-node", "2", "--master_addr", "127.0.0.1", "--master_port", port, "--rdzv_timeout", "60",
            "--nnodes", "1:2"]
    procs = [_start("elastic", out, [*node, "--node_rank", str(n)], f"run{n}", extra=["--hold", "5"]) for n in (0, 1)]
    await_file(out / "ends0", procs)
    time.sleep(delay)
    procs[1].kill()
    procs[1].communicate()
    await_file(out / "changes0", procs[:1])
    started = time.time()
    procs[1] = _start("elastic", out, [*node, "--node_rank", "1"], "run1-again", extra=["--hold", "5"])
    err = ""
    for proc in procs:
        err += proc.communicate(timeout=300)[1]
        if proc.returncode != 0:
            raise RuntimeError(err)
    first = min(t for log in ("ends2", "ends3") for b, t in ends_of(out / log) if t > started)
    joined = [json.loads(line) for line in (out / "changes0").read_text().splitlines()][-1]
    # a batch a rank's file records twice was trained again (node 1's files hold both its launchers' ranks)
    again = max(len(batches) - len(set(batches)) for batches in
                ([b for b, _ in ends_of(log)] for log in out.glob("ends*")))
    return first - started, joined["seconds"], again


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for n in range(args.trials):
        delay = random.uniform(0.0, 0.6)
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(trial(delay, Path(tmp)))
        start, stall, again = rows[-1]
        print(f"trial {n + 1}: node 1 killed at {delay:.2f} s: start to step {start:.2f} s, stall {stall:.2f} s, "
              f"{again} batch(es) again", flush=True)
    for i, name in enumerate(("start to step (s)", "stall (s)", "batches again")):
        values = [row[i] for row in rows]
        print(f"{name}: median {statistics.median(values):.2f}, max {max(values):.2f}")


if __name__ == "__main__":
    main()
