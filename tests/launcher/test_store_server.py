"""The launcher's store server (c10d's wire protocol in the standard library) against the installed
torch's own client: every call a rank, DeepSpeed or DCP can make of the store, and a gloo group
formed through it. A torch whose protocol changed fails here. torch's clients run in processes of
their own: some of its calls hold the GIL while they wait for the answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lockstep.launcher.store_server import StoreServer
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

_CLIENT = textwrap.dedent("""
    import datetime, json, sys, threading, time
    import torch.distributed as d
    port = int(sys.argv[1])
    def client(seconds=10):
        return d.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=seconds))
    c = client()
    out = {}
    c.set("a", "1")
    out["get"] = c.get("a").decode()
    out["from_launcher"] = c.get("launcher").decode()
    out["add"] = [c.add("n", 3), c.add("n", -1), c.add("n", 0)]
    out["check"] = [c.check(["a", "missing"]), c.check(["a"])]
    out["compare_set"] = [c.compare_set("a", "1", "2").decode(), c.compare_set("a", "9", "3").decode(),
                          c.compare_set("fresh", "", "v").decode(), c.compare_set("absent", "x", "v").decode()]
    c.append("ap", "x"); c.append("ap", "y")
    out["append"] = c.get("ap").decode()
    c.multi_set(["m1", "m2"], ["1", "2"])
    out["multi_get"] = [v.decode() for v in c.multi_get(["m1", "m2"])]
    out["delete"] = [c.delete_key("m1"), c.delete_key("m1")]
    out["list_keys"] = sorted(c.list_keys())
    out["num_keys"] = c.num_keys()
    started = time.monotonic()
    c.set("asking", "1")
    out["waited_for"] = c.get("later").decode()  # the launcher sets it 0.5 s after "asking"
    out["waited"] = time.monotonic() - started
    try:
        c.wait(["never"], datetime.timedelta(seconds=0.3))
        out["timeout"] = "none"
    except Exception as e:
        out["timeout"] = type(e).__name__
    c.set("after_timeout", "ok")
    out["after_timeout"] = c.get("after_timeout").decode()
    c.queue_push("q", "1"); c.queue_push("q", "2")
    out["queue"] = [c.queue_len("q"), c.queue_pop("q").decode(), c.queue_pop("q").decode(), c.queue_len("q")]
    other = client()
    threading.Timer(0.3, lambda: other.queue_push("q2", "v")).start()
    out["queue_pop_waits"] = c.queue_pop("q2").decode()
    threading.Timer(0.3, lambda: other.barrier("b", 2)).start()
    c.barrier("b", 2)
    c.barrier("b", 2)  # complete: at once
    out["barrier"] = True
    print(json.dumps(out), flush=True)
""")


def test_every_call_of_torchs_client_gets_torchs_answers(tmp_path) -> None:
    server = StoreServer()
    try:
        server.set("launcher", "L")
        threading.Thread(target=lambda: (server.get("asking"), time.sleep(0.5), server.set("later", b"z")),
                         daemon=True).start()
        done = subprocess.run([sys.executable, "-c", _CLIENT, str(server.port)], capture_output=True, text=True,
                              timeout=90, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout.splitlines()[-1])
        # and the launcher's own calls see what the client left
        assert server.get("a") == b"2" and server.add("n", 1) == 3 and server.check(["ap", "m2"])
        assert server.multi_get(["ap", "m2"]) == [b"xy", b"2"] and not server.check(["m1"])
        assert server.compare_set("fresh", "v", "w") == b"w" and server.delete_key("fresh")
    finally:
        server.close()
    assert got["get"] == "1" and got["from_launcher"] == "L"
    assert got["add"] == [3, 2, 2] and got["check"] == [False, True]
    assert got["compare_set"] == ["2", "2", "v", "x"]  # c10d answers a missing key with the expected value
    assert got["append"] == "xy" and got["multi_get"] == ["1", "2"] and got["delete"] == [True, False]
    assert set(got["list_keys"]) >= {"a", "ap", "m2", "n", "fresh", "launcher"} and "m1" not in got["list_keys"]
    assert got["num_keys"] == len(got["list_keys"]) + 1  # and "init/", where c10d's clients count themselves
    assert got["waited_for"] == "z" and 0.3 < got["waited"] < 5
    assert got["timeout"] != "none" and got["after_timeout"] == "ok"  # a timed-out wait leaves the client usable
    assert got["queue"] == [2, "1", "2", 0] and got["queue_pop_waits"] == "v" and got["barrier"]


def test_ranks_form_a_gloo_group_through_it_and_a_dropped_client_leaves_it_serving(tmp_path) -> None:
    server = StoreServer()
    job = textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        g = dist.new_group([0, 1])
        dist.barrier(group=g)
        print(int(t.item()), flush=True)
        dist.destroy_process_group()
    """)
    try:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": "2",
               "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"}
        # a client that goes away in the middle of a message is dropped alone
        half = subprocess.run([sys.executable, "-c", f"import socket, struct; s = socket.create_connection(('127.0.0.1', "
                               f"{server.port})); s.sendall(struct.pack('<BI', 0, 0x3C85F7CE) + b'\\x01\\x09')"],
                              timeout=30)
        assert half.returncode == 0
        ranks = [subprocess.Popen([sys.executable, "-c", job], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=90) for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], [o[1][-2000:] for o in outs]
        assert [o[0].split()[-1] for o in outs] == ["3", "3"]
    finally:
        server.close()
    assert not server._thread.is_alive()  # close() ended the serving thread
