"""What checkpoints in a bucket cost the Trainer: steps/s of 2 ranks saving a 160 MB checkpoint to
S3 every 10 steps against the same training without saves, side by side (alternating order, rounds),
and the rate of the Trainer's uploads against the client alone on the same server (and, to tell
the bucket's share from the save's, the same saves to a local folder). The script starts
a SeaweedFS server (and stops it at the end) and runs each configuration under the launcher
(``--launcher torchrun``: under torchrun, which starts each rank in a session of its own).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/s3_checkpoint_cost.py [--rounds 3] [--steps 40] [--idle-server]

On a machine where training takes every core, the server itself (which here shares the machine)
takes CPU from training; ``--idle-server`` runs it under SCHED_IDLE, closer to a server elsewhere.
To tell the machine's share of the cost from lockstep's, a fourth configuration trains without
saves while a plain client process (``S3ObjectStore.upload_object`` under SCHED_IDLE, as lockstep's
upload process runs) uploads a checkpoint-sized file beside it, starting one upload every
``--every`` steps' worth of the no-save run's time (or as soon as the last one ended, if later):
the server's work and the bytes' trip are the same, lockstep's machinery is absent. A fifth trains without saves
beside a process that only spins under SCHED_IDLE: what any busy work beside training costs on this
machine, however low its priority. The server's CPU seconds per 160 MB uploaded (from ``/proc``) say
how much of the machine the bytes' trip takes.

"ratio" is of the medians; "paired" the median of each round's ratio to that round's no-save run.

The model is an MLP of 4 layers 1824 wide (13.3 M parameters) with AdamW state: a checkpoint of
about 160 MB (weights and both moment buffers), which rank 0 writes (DDP). Steps/s is over the
steps after a warmup of 5, saves during them included; the end of ``fit`` (which waits for the last
upload) is not in it. The upload rate is bytes over seconds of each checkpoint file's upload
(median, and the slowest: uploads queued behind a slow one may run after training has ended),
against ``S3ObjectStore.upload_object`` of a 160 MB file with nothing else running; lockstep's
``Uploader`` alone uploads the same file in turn with it, to tell its own cost from the machine's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "objectstore"))
WIDTH, LAYERS, WARMUP = 1824, 4, 5


def worker(args: argparse.Namespace) -> None:
    """One configuration under the launcher; rank 0 prints a JSON line."""
    from torch.utils.data import DataLoader, TensorDataset

    from lockstep import Callback, Model, Trainer, dist

    class Wide(Model):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH),
                                                                                  torch.nn.Tanh())])

        def forward(self, batch):
            return self.net(batch[0])

        def loss(self, outputs, batch):
            return torch.nn.functional.mse_loss(outputs, batch[1])

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def batch_end(self, state, logger) -> None:
            self.times.append(time.perf_counter())

    n = args.batch * dist.get_world_size() * (WARMUP + args.steps)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
    model, clock = Wide(), Clock()
    folder = {"none": None, "local": "checkpoints/{run_name}", "s3": f"s3://{args.bucket}/{{run_name}}"}[args.mode]
    save = {} if folder is None else {
        "save_folder": folder, "save_interval": f"{args.every}ba", "save_num_checkpoints_to_keep": 2}
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=args.batch, sampler=dist.get_sampler(data)),
                      optimizers=torch.optim.AdamW(model.parameters(), lr=1e-4), max_duration=f"{WARMUP + args.steps}ba",
                      device="cpu", progress_bar=False, log_to_console=False, run_name=f"{args.mode}-{os.getpid()}",
                      callbacks=[clock], **save)
    trainer.fit()
    timed = clock.times[WARMUP - 1:]
    result = {"steps_per_s": (len(timed) - 1) / (timed[-1] - timed[0])}
    if trainer.saver is not None and trainer.saver.uploader is not None:
        timings = trainer.saver.uploader.timings
        result["upload_mb_s"] = statistics.median(b / s / 1e6 for b, s in timings) if timings else None
        result["slowest_upload_mb_s"] = min(b / s / 1e6 for b, s in timings) if timings else None
        result["checkpoint_mb"] = timings[0][0] / 1e6 if timings else None
        result["uploaded_mb"] = sum(b for b, _ in timings) / 1e6
        result["dropped"] = len(trainer.saver.uploader.dropped)  # overtaken while waiting to upload
    if dist.get_global_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(mode: str, args: argparse.Namespace, env: dict[str, str], server_pid: int, period: float = 0.0) -> dict:
    side, side_folder = None, tempfile.TemporaryDirectory()
    if mode in ("client", "spin"):  # no saves, while a plain client uploads (or an idle process spins) beside
        flag = "--side-upload" if mode == "client" else "--side-spin"
        side = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), flag, "--bucket", args.bucket,
                                 "--mb", str(args.mb), "--period", str(period)],
                                env=env, stdout=subprocess.PIPE, text=True, cwd=side_folder.name)
        assert side.stdout is not None
        side.stdout.readline()  # ready: its file is written
    server_before = cpu_seconds(server_pid)
    try:
        with tempfile.TemporaryDirectory() as cwd:
            launcher = ["lockstep", "-n", "2"] if args.launcher == "lockstep" else \
                ["torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            out = subprocess.run([sys.executable, "-m", *launcher, str(Path(__file__).resolve()),
                                  "--worker", "--mode", "none" if side is not None else mode, "--bucket", args.bucket,
                                  "--steps", str(args.steps), "--every", str(args.every),
                                  "--batch", str(args.batch)],
                                 cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        if side is not None:  # killed at once: an upload under way may be starved of CPU for minutes
            side.kill()
            rates = side.communicate(timeout=60)[0].split()  # one line per upload that ended
        side_folder.cleanup()
    if out.returncode != 0:
        raise SystemExit(f"{mode} run failed: {out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["server_cpu_s"] = cpu_seconds(server_pid) - server_before
    if mode == "client":
        result["upload_mb_s"] = statistics.median(float(r) for r in rates) if rates else None
        result["uploaded_mb"] = len(rates) * args.mb
    return result


def side_upload(args: argparse.Namespace) -> None:
    """Upload a file of ``--mb`` MB (written in the working folder, which the caller removes), one
    upload every ``--period`` seconds (or as soon as the last ended), as a plain client under
    SCHED_IDLE (as lockstep's upload process runs), until killed; print each upload's MB/s."""
    from lockstep import idle
    from lockstep.objectstore import S3ObjectStore

    idle.yield_to_training()
    store, path = S3ObjectStore(args.bucket), Path("blob")
    path.write_bytes(os.urandom(int(args.mb * 1e6)))
    print("ready", flush=True)
    for n in itertools.count():
        started = time.perf_counter()
        store.upload_object(f"side/{n % 2}", path)
        print(f"{args.mb / (time.perf_counter() - started):.1f}", flush=True)
        time.sleep(max(0.0, started + args.period - time.perf_counter()))


def side_spin() -> None:
    """Spin under SCHED_IDLE until killed: busy work that should take only the CPU training leaves."""
    from lockstep import idle

    idle.yield_to_training()
    print("ready", flush=True)
    while True:
        pass


def alone(bucket: str, mb: float) -> tuple[float, float]:
    """MB/s of a file of ``mb`` MB with nothing else running, median of 3 each, taking turns: the
    client (``S3ObjectStore.upload_object``), then lockstep's upload path (the Trainer's
    ``Uploader``: its child process, under SCHED_IDLE, timed as the Trainer's uploads are)."""
    from lockstep.checkpoint.remote import RemoteFolder, Uploader
    from lockstep.objectstore import S3ObjectStore

    store = S3ObjectStore(bucket)
    client: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "blob"
        path.write_bytes(os.urandom(int(mb * 1e6)))
        uploader = Uploader(RemoteFolder.of(f"s3://{bucket}/alone-uploader", Path(tmp)), 0)
        try:
            for i in range(3):
                started = time.perf_counter()
                store.upload_object(f"alone/{i}", path)
                client.append(mb / (time.perf_counter() - started))
                uploader.upload(f"ba{i}", [(path, f"ba{i}/blob")])
                uploader.drain()
        finally:
            uploader.close()
        failure = uploader.state()[1]
        if failure is not None:
            raise SystemExit(f"the uploader alone failed: {failure}")
    return statistics.median(client), statistics.median(b / s / 1e6 for b, s in uploader.timings)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", default="none", choices=["none", "local", "s3"])
    p.add_argument("--side-upload", action="store_true")
    p.add_argument("--side-spin", action="store_true")
    p.add_argument("--period", type=float, default=0.0, help="seconds from one side upload's start to the next")
    p.add_argument("--mb", type=float, default=160.0, help="size of the plain client's file (--side-upload)")
    p.add_argument("--bucket", default="bench")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--skip", default="", choices=["", "local", "spin", "local,spin"],
                   help="leave out the local-folder or the spinner configuration (or both)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step (longer steps: saves further apart)")
    p.add_argument("--launcher", default="lockstep", choices=["lockstep", "torchrun"],
                   help="torchrun starts each rank in a session of its own (see docs/launcher.md)")
    p.add_argument("--idle-server", action="store_true",
                   help="run SeaweedFS under SCHED_IDLE, as if it were on another machine")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.side_upload:
        side_upload(args)
        return
    if args.side_spin:
        side_spin()
        return
    import seaweed

    server = seaweed.start(idle=args.idle_server)
    try:
        server.create_bucket(args.bucket)
        env = {**os.environ, **server.env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        os.environ.update(server.env)
        modes = [m for m in ("none", "local", "s3", "client", "spin") if m not in args.skip.split(",")]
        results: dict[str, list[dict]] = {mode: [] for mode in modes}
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                done = results["none"]  # the plain client uploads at the cadence of the saves
                period = args.every / statistics.median(x["steps_per_s"] for x in done) if done else 0.0
                results[mode].append(run(mode, args, env, server.process.pid, period))
                print(f"round {r} {mode}: {results[mode][-1]}", file=sys.stderr, flush=True)
        mb = statistics.median(x["checkpoint_mb"] for x in results["s3"])
        alone_client, alone_uploader = alone(args.bucket, mb)
    finally:
        server.stop()
    med = {mode: statistics.median(x["steps_per_s"] for x in runs) for mode, runs in results.items()}
    upload = statistics.median(x["upload_mb_s"] for x in results["s3"])
    slowest = statistics.median(x["slowest_upload_mb_s"] for x in results["s3"])
    # a round whose plain client finished no upload beside training has no rate
    beside = statistics.median([x["upload_mb_s"] for x in results["client"] if x["upload_mb_s"]] or [float("nan")])
    print(f"2 ranks (gloo, CPU, {args.launcher}), batch {args.batch} a rank, {args.steps} timed steps, "
          f"median of {args.rounds} rounds; "
          f"checkpoint {mb:.0f} MB to S3 (SeaweedFS on 127.0.0.1{', SCHED_IDLE' if args.idle_server else ''}) "
          f"every {args.every} steps")
    # each round against its own no-save run: drift between rounds cancels
    paired = {mode: statistics.median(x["steps_per_s"] / y["steps_per_s"]
                                      for x, y in zip(results[mode], results["none"])) for mode in results}
    print(f"{'':<46}{'steps/s':>10}{'ratio':>8}{'paired':>8}")
    rows = [("none", "no saves"), ("local", "save to a local folder"),
            ("s3", f"save to s3:// every {args.every} steps"), ("client", "no saves, a plain client uploading as often"),
            ("spin", "no saves, an idle-priority spinner beside")]
    for mode, label in (row for row in rows if row[0] in modes):
        print(f"{label:<46}{med[mode]:>10.2f}{med[mode] / med['none']:>8.3f}{paired[mode]:>8.3f}")
    print(f"{'s3:// against the plain client beside':<46}{'':>10}{med['s3'] / med['client']:>8.3f}")
    print(f"{'upload MB/s':<46}")
    print(f"{'  Trainer (rank 0, median file)':<46}{upload:>10.0f}{upload / alone_client:>8.3f}")
    print(f"{'  Trainer (rank 0, slowest file)':<46}{slowest:>10.0f}{slowest / alone_client:>8.3f}")
    print(f"{'  plain client beside training (median)':<46}{beside:>10.0f}{beside / alone_client:>8.3f}")
    print(f"{'  lockstep Uploader alone':<46}{alone_uploader:>10.0f}{alone_uploader / alone_client:>8.3f}")
    print(f"{'  S3ObjectStore alone':<46}{alone_client:>10.0f}{1.0:>8.3f}")
    dropped = statistics.median(x.get("dropped", 0) for x in results["s3"])
    print(f"{'checkpoints dropped from the upload queue':<46}{dropped:>10.0f}  (of each run's, median)")
    print("server CPU seconds per 160 MB uploaded")
    for mode, label in (("s3", "  Trainer's uploads"), ("client", "  plain client beside training")):
        per = statistics.median(x["server_cpu_s"] / x["uploaded_mb"] * 160 for x in results[mode] if x["uploaded_mb"])
        print(f"{label:<46}{per:>10.2f}")


if __name__ == "__main__":
    main()
