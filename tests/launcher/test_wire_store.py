"""The launchers' own store client (lockstep.launcher.wire_store) against torch's TCPStore server:
every call it makes sees what torch's client wrote and the other way round, a wait past its
timeout is cancelled and reported, a server that does not speak c10d gets torch's client, and a
launcher whose node hosts no store runs its job without importing torch."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from lockstep.launcher import wire_store
from lockstep.launcher.wire_store import WireStore
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server() -> TCPStore:
    return TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)


def test_each_call_sees_what_torchs_client_wrote_and_the_other_way_round(server: TCPStore) -> None:
    ours = WireStore("127.0.0.1", server.port, timeout=5)
    ours.set("a", "1")
    assert server.get("a") == b"1"
    server.set("b", b"\x00two")
    assert ours.get("b") == b"\x00two"
    assert ours.add("n", 5) == 5 and server.add("n", 2) == 7 and ours.add("n", 0) == 7
    assert ours.check(["a", "b"]) and not ours.check(["a", "missing"])
    assert server.check(["a"])
    assert ours.compare_set("v", "", "first") == b"first"  # absent, expected empty: set
    assert server.compare_set("v", "other", "x") == b"first"  # present and not as expected: left
    assert ours.compare_set("v", "first", "second") == b"second" and server.get("v") == b"second"
    # an append is not answered: a call that is (add) tells each client its appends are in
    ours.append("log", "x\n")
    assert ours.add("sync", 1) == 1
    server.append("log", "y\n")
    assert server.add("sync", 1) == 2
    ours.append("log", b"z\n")
    assert ours.add("sync", 1) == 3
    assert server.get("log") == b"x\ny\nz\n" == ours.get("log")
    server.set("m2", "22")
    assert ours.multi_get(["a", "m2"]) == [b"1", b"22"]
    ours.close()


def test_get_waits_for_a_key_and_a_wait_past_the_timeout_is_cancelled(server: TCPStore) -> None:
    ours = WireStore("127.0.0.1", server.port, timeout=1)
    threading.Timer(0.3, lambda: server.set("late", "here")).start()
    assert ours.get("late") == b"here"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no key never within 1 s"):
        ours.get("never")
    assert 0.9 < time.monotonic() - start < 5
    assert ours.add("after", 1) == 1  # the cancel left the connection in step


def test_a_server_that_is_not_a_c10d_store_gets_torchs_client() -> None:
    port = free_port()
    with socket.create_server(("127.0.0.1", port)) as listener:
        def answer_wrong() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(10)
                conn.sendall(b"nope")

        threading.Thread(target=answer_wrong, daemon=True).start()
        assert wire_store.connect("127.0.0.1", port, 5, lambda: "torch's client") == "torch's client"


def test_neither_the_launcher_that_hosts_the_store_nor_the_others_import_torch(tmp_path: Path) -> None:
    # node 0 of a two-node job serves the store itself (store_server), node 1's launcher joins it
    # with its own client, and their ranks need no torch either; python -X importtime lists what
    # each launcher imported
    port = free_port()
    script = tmp_path / "rank.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'])\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCKSTEP_PREFORK": "0"}
    common = ["--world_size", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)]
    nodes = [subprocess.Popen([sys.executable, "-X", "importtime", "-m", "lockstep", "-n", "1", "--node_rank",
                               str(node), *common], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = [p.communicate(timeout=90) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    imported = [{line.rsplit("|", 1)[1].strip() for line in err.splitlines() if line.startswith("import time:")}
                for _, err in outs]
    assert "lockstep.launcher.store_server" in imported[0] and "torch" not in imported[0]
    assert "lockstep.launcher.wire_store" in imported[1] and "torch" not in imported[1]
    assert "rank 0" in outs[0][0] and "rank 1" in outs[1][0]  # their ranks ran
