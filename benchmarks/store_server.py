"""Throughput of the store a launcher serves (`lockstep/launcher/store_server.py`) against c10d's own
TCPStore server, side by side: K client processes (torch's TCPStore client, as ranks use it) each
set, get and add N keys at once; aggregate calls per second, the median of several runs each,
taken in turn.

    .venv/bin/python benchmarks/store_server.py --clients 8 --calls 2000 --runs 5
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lockstep.launcher.store_server import StoreServer  # noqa: E402

_CLIENT = """
import datetime, sys, torch.distributed as d
port, name, calls = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
c = d.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=60))
c.add("ready", 1)
c.wait(["go"])
for i in range(calls):
    c.set(f"{name}/{i}", "v")
    c.get(f"{name}/{i}")
    c.add("count", 1)
c.add("done", 1)
"""


def _one_run(port: int, server: Any, clients: int, calls: int) -> float:
    """Calls per second of ``clients`` processes at once (from the go to the last one's end)."""
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, str(port), f"client{k}", str(calls)])
             for k in range(clients)]
    while int(server.get("ready")) < clients:
        time.sleep(0.01)
    server.set("go", "1")
    started = time.perf_counter()
    for p in procs:
        p.wait()
    took = time.perf_counter() - started
    if any(p.returncode for p in procs):
        raise SystemExit("a client failed")
    return 3 * clients * calls / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000, help="set+get+add rounds per client")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    import torch.distributed as dist

    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(args.runs):
        server = StoreServer()
        server.add("ready", 0)
        try:
            ours.append(_one_run(server.port, server, args.clients, args.calls))
        finally:
            server.close()
        c10d = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60), wait_for_workers=False)
        c10d.add("ready", 0)
        theirs.append(_one_run(c10d.port, c10d, args.clients, args.calls))
        del c10d
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"lockstep store_server: {a:,.0f} calls/s (runs: {', '.join(f'{x:,.0f}' for x in ours)})")
    print(f"c10d TCPStore server:  {b:,.0f} calls/s (runs: {', '.join(f'{x:,.0f}' for x in theirs)})")
    print(f"ratio lockstep/c10d: {a / b:.2f} ({args.clients} clients x {args.calls} rounds, {args.runs} runs each)")


if __name__ == "__main__":
    main()
