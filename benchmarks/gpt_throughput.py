"""Tokens/s, MFU and memory of the GPT job: the Trainer against hand-written DDP and FSDP loops.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpt_throughput.py              # about 10 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpt_throughput.py --runs 5 --steps 60
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gpt_throughput.py --runs 1 --steps 3 --layers 8 --dim 512 \
        --impls plain-ddp trainer-ddp plain-fsdp trainer-fsdp        # memory of a 25M-parameter model

Each run is a fresh 2-rank job of ``benchmarks/gpt_job.py`` (gloo, one thread per rank): the
hand-written loops under ``torchrun --standalone --nproc_per_node 2``, the Trainer under
``lockstep -n 2 --run_directory TMP``. Implementations alternate in order from run to run. The
table gives medians over the runs; the Trainer's ratio is against the hand-written loop of the same
parallelism. MFU is the model's FLOPs (6N + 12 L d T per token) per second per rank over the peak
of one core, measured here as the best of several 1024x1024 fp32 matmuls on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

JOB = Path(__file__).resolve().parent / "gpt_job.py"
IMPLS = ["plain-ddp", "trainer-ddp", "plain-fsdp", "trainer-fsdp", "trainer-fsdp-ac", "trainer-fsdp-post"]
BASELINE = {"trainer-ddp": "plain-ddp", "trainer-fsdp": "plain-fsdp", "trainer-fsdp-ac": "plain-fsdp",
            "trainer-fsdp-post": "plain-fsdp"}


def matmul_peak(n: int = 1024, repeats: int = 50) -> float:
    """FLOP/s of one core on an fp32 matmul (the best of ``repeats``)."""
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def run(impl: str, args: argparse.Namespace, root: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{impl}-", dir=root))
    job = [str(JOB), "--impl", impl, "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(out),
           "--layers", str(args.layers), "--dim", str(args.dim), "--heads", str(args.heads)]
    if impl.startswith("trainer"):
        cmd = [sys.executable, "-m", "lockstep", "-n", "2", "--run_directory", str(out / "run"), *job]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *job]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    result = out / "result.json"
    if proc.returncode != 0 and result.exists():
        # rank 0 wrote the figures; a rank that aborts on its way out (gloo's threads at exit)
        # does not make them wrong
        print(f"{impl}: exit {proc.returncode} after its result was written; the run counts", flush=True)
    elif proc.returncode != 0:
        sys.exit(f"{impl} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS)
    parser.add_argument("--layers", type=int, default=4, help="the model's size (train_gpt.py's defaults)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    peak = matmul_peak()
    results: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="gpt-throughput-") as tmp:
        for r in range(args.runs):
            # each Trainer run right next to its hand-written loop, in alternating order
            order = args.impls if r % 2 == 0 else list(reversed(args.impls))
            for impl in order:
                results[impl].append(run(impl, args, Path(tmp)))
                print(f"run {r + 1}/{args.runs} {impl:16s} {results[impl][-1]['tokens_per_s']:8.0f} tokens/s",
                      flush=True)
    print()
    params = next(iter(results.values()))[0]["params"]
    print(f"GPT of examples/train_gpt.py ({params / 1e6:.2f}M parameters: {args.layers} layers of {args.dim}; "
          f"16 x 128 bytes per rank), 2 ranks, gloo, 1 thread "
          f"each, {time.strftime('%Y-%m-%d')}; {args.runs} runs of {args.steps} steps after {args.warmup}; "
          f"medians; one-core fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'implementation':16s} {'tokens/s':>9s} {'vs hand':>8s} {'pairwise':>9s} {'MFU':>6s} "
          f"{'peak RSS MiB/rank':>18s} {'params+grads+optim MiB/rank':>28s}")
    for impl in args.impls:
        rows = results[impl]
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        base = BASELINE.get(impl)
        ratio = pairwise = ""
        if base in results:  # the median of medians, and the median of each run's own ratio
            ratio = f"{tps / statistics.median(r['tokens_per_s'] for r in results[base]):.3f}x"
            pairwise = f"{statistics.median(a['tokens_per_s'] / b['tokens_per_s'] for a, b in zip(rows, results[base])):.3f}x"
        mfu = statistics.median(r["flops_per_s_per_rank"] for r in rows) / peak
        rss = [statistics.median(r["peak_rss_mib"][i] for r in rows) for i in range(2)]
        state = rows[0]["state_mib"]
        print(f"{impl:16s} {tps:9.0f} {ratio:>8s} {pairwise:>9s} {mfu:6.1%} {' / '.join(f'{x:.0f}' for x in rss):>18s} "
              f"{' / '.join(f'{x:.2f}' for x in state):>28s}")
        each = " ".join(f"{r['tokens_per_s']:.0f}" for r in rows)
        print(f"{'':16s} runs {each}")


if __name__ == "__main__":
    main()
