"""How much CPU a machine has beside 2-rank training, and what an upload to S3 takes of it: the two
numbers that decide whether checkpoints in a bucket can be nearly free on that machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_headroom.py [--steps 60] [--rounds 2] [--mb 160]

Part 1 trains the model of ``s3_checkpoint_cost.py`` (an MLP 1824 wide, 4 layers, AdamW, batch 16 a
rank) with plain DDP over gloo, 2 processes, and reports steps/s and each rank's CPU use and time
spent waiting for a core (``/proc/PID/task/*/schedstat``, in seconds per second), alone and beside
processes that only spin (under ``SCHED_IDLE``, or at nice 19). The ranks and the spinners share
one session here: where the kernel shares CPU between sessions first (``sched_autogroup``), a
spinner in another session takes a share whatever its priority (docs/launcher.md, "Process hygiene").

Part 2 starts a SeaweedFS server and uploads a file with ``S3ObjectStore`` as lockstep does, then
with the payload's SHA-256 signature off (``client_config={"s3": {"payload_signing_enabled": False}}``;
boto3 signs every payload over plain http otherwise), reporting MB/s and the CPU seconds the client
(``getrusage``) and the server (``/proc``) spent on it.
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WIDTH, LAYERS, BATCH, WARMUP = 1824, 4, 16, 5


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a core, seconds waiting for one) of every thread of ``pid``."""
    ran = waited = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            on_cpu, on_queue, _ = open(path).read().split()
        except (OSError, ValueError):
            continue
        ran, waited = ran + int(on_cpu), waited + int(on_queue)
    return ran / 1e9, waited / 1e9


def rank(index: int, port: int, steps: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=index, world_size=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for _ in range(WARMUP):
        step()
    dist.barrier()
    before, started = schedstat(os.getpid()), time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    seconds, after = time.perf_counter() - started, schedstat(os.getpid())
    results.put((index, steps / seconds, (after[0] - before[0]) / seconds, (after[1] - before[1]) / seconds))
    dist.destroy_process_group()


def training(label: str, beside: list[list[str]], port: int, steps: int) -> None:
    import torch.multiprocessing as mp

    spinners = [subprocess.Popen(command) for command in beside]
    try:
        time.sleep(0.5)
        context = mp.get_context("spawn")
        results = context.Queue()
        ranks = [context.Process(target=rank, args=(i, port, steps, results)) for i in range(2)]
        for process in ranks:
            process.start()
        rows = sorted(results.get(timeout=600) for _ in ranks)
        for process in ranks:
            process.join()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    use = "  ".join(f"rank {i}: core {ran:.2f} waits {waited:.2f}" for i, _, ran, waited in rows)
    print(f"{label:26s} {rows[0][1]:6.2f}  {use}", flush=True)


def cpu_seconds(pid: int) -> float:
    """User and system seconds of ``pid`` and its children that are alive."""
    pids = [pid] + [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    total = 0.0
    for each in pids:
        fields = open(f"/proc/{each}/stat").read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def uploads(mb: int, rounds: int) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "objectstore"))
    import seaweed

    from lockstep.objectstore import S3ObjectStore

    server = seaweed.start()
    try:
        os.environ.update(server.env)
        server.create_bucket("headroom")
        with tempfile.NamedTemporaryFile() as file:
            file.write(os.urandom(mb << 20))
            file.flush()
            settings = {"signed (lockstep's default)": {},
                        "unsigned payload": {"s3": {"payload_signing_enabled": False}}}
            print(f"\nuploading {mb} MB to SeaweedFS on 127.0.0.1: MB/s, client CPU-s, server CPU-s")
            for attempt in range(rounds):
                for label, config in settings.items():
                    store = S3ObjectStore("headroom", client_config=config)
                    store.upload_object("warmup", file.name)
                    mine, theirs = resource.getrusage(resource.RUSAGE_SELF), cpu_seconds(server.process.pid)
                    started = time.perf_counter()
                    store.upload_object(f"{attempt}-{len(label)}", file.name)
                    seconds = time.perf_counter() - started
                    used = resource.getrusage(resource.RUSAGE_SELF)
                    client = used.ru_utime + used.ru_stime - mine.ru_utime - mine.ru_stime
                    print(f"  {label:28s} {mb / seconds:6.0f}  {client:5.2f}  "
                          f"{cpu_seconds(server.process.pid) - theirs:5.2f}", flush=True)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mb", type=int, default=160)
    args = parser.parse_args()
    spin = [sys.executable, "-c", "while True: pass"]
    configurations = {"alone": [], "one SCHED_IDLE spinner": [["chrt", "--idle", "0", *spin]],
                      "two SCHED_IDLE spinners": [["chrt", "--idle", "0", *spin]] * 2,
                      "one nice 19 spinner": [["nice", "-n", "19", *spin]]}
    print(f"2 ranks (gloo), {args.steps} steps: steps/s, and each rank's seconds per second on a core "
          f"and waiting for one")
    port = 29611
    for _ in range(args.rounds):
        for label, beside in configurations.items():
            training(label, beside, port, args.steps)
            port += 1
    uploads(args.mb, args.rounds)


if __name__ == "__main__":
    main()
