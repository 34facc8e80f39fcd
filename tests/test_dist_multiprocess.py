"""Multi-process tests of lockstep.dist and lockstep.testing.run_distributed (gloo, world size 2).

Each spawned run costs a few seconds on a small machine, so one run checks many things at once. The
functions run on the ranks must live at module level (they are pickled into spawned processes).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import string
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

from lockstep import dist
from lockstep.testing import run_distributed

WORLD_SIZE = 2


def _getters_and_collectives() -> dict[str, Any]:
    import torch._inductor.config as inductor

    rank = dist.get_global_rank()
    out: dict[str, Any] = {
        "initialized": dist.is_initialized(),
        "getters": (
            dist.get_world_size(),
            rank,
            dist.get_local_rank(),
            dist.get_local_world_size(),
            dist.get_node_rank(),
        ),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "compile threads": inductor.compile_threads,
    }
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        tensor = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        returned = dist.all_reduce(tensor, op)
        out[op] = (returned is tensor, tensor.tolist())
    out["int_sum"] = dist.all_reduce(torch.tensor([rank + 1]), "SUM").tolist()

    tensor = torch.full((3,), float(rank))
    out["broadcast"] = dist.broadcast(tensor, src=1).tolist()
    objs: list[Any] = [f"from rank {rank}", {"rank": rank}] if rank == 0 else [None, None]
    out["broadcast_object_list"] = (dist.broadcast_object_list(objs, src=0), objs)
    out["all_gather"] = [t.tolist() for t in dist.all_gather(torch.arange(2) + 10 * rank)]
    out["all_gather_object"] = dist.all_gather_object({"rank": rank, "name": f"r{rank}"})
    out["gather_object"] = dist.gather_object(("from", rank), dst=1)
    out["scatter_object"] = dist.scatter_object([{"to": 0}, "y" * 3000] if rank == 0 else None, src=0)
    dist.barrier()

    waited: list[Any] = []  # as in an elastic job: every wait through the waiter, none inside torch
    dist.set_collective_waiter(lambda work: (waited.append(work), work.wait()))
    try:
        sent: list[Any] = [b"z" * 5000, {"rank": rank}] if rank == 1 else [None, None]
        dist.broadcast_object_list(sent, src=1)
        out["waited_objects"] = (sent, dist.all_gather_object("x" * (100 + 900 * rank)), len(waited))
        out["waited_gather_scatter"] = (dist.gather_object("g" * (10 + 5000 * rank), dst=0),
                                        dist.scatter_object(["a" * 7000, {"to": 1}] if rank == 1 else None, src=1),
                                        len(waited))
    finally:
        dist.set_collective_waiter(None)

    out["sampler"] = {}
    for size, shuffle, drop_last in ((10, True, False), (11, True, False), (11, False, True)):
        sampler = dist.get_sampler(list(range(size)), shuffle=shuffle, drop_last=drop_last, seed=7)
        sampler.set_epoch(1)
        out["sampler"][(size, shuffle, drop_last)] = list(sampler)
    return out


@pytest.mark.timeout(120)
def test_getters_collectives_and_sampler() -> None:
    results = run_distributed(_getters_and_collectives, WORLD_SIZE, timeout=90)
    for rank, out in enumerate(results):
        assert out["initialized"] is True
        assert out["getters"] == (2, rank, rank, 2, 0)
        assert (out["omp"], out["threads"], out["compile threads"]) == ("1", 1, 1)  # no compile workers either
        assert out["SUM"] == (True, [3.0, 30.0])
        assert out["AVG"] == (True, [1.5, 15.0])
        assert out["MAX"] == (True, [2.0, 20.0])
        assert out["MIN"] == (True, [1.0, 10.0])
        assert out["PRODUCT"] == (True, [2.0, 200.0])
        assert out["int_sum"] == [3]
        assert out["broadcast"] == [1.0, 1.0, 1.0]
        assert out["broadcast_object_list"] == (None, ["from rank 0", {"rank": 0}])
        assert out["all_gather"] == [[0, 1], [10, 11]]
        assert out["all_gather_object"] == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]
        assert out["waited_objects"] == ([b"z" * 5000, {"rank": 1}], ["x" * 100, "x" * 1000], 4)
        assert out["gather_object"] == ([("from", 0), ("from", 1)] if rank == 1 else None)
        assert out["scatter_object"] == [{"to": 0}, "y" * 3000][rank]
        assert out["waited_gather_scatter"] == (["g" * 10, "g" * 5010] if rank == 0 else None,
                                                ["a" * 7000, {"to": 1}][rank], 8)

    for (size, _shuffle, drop_last), rank0 in results[0]["sampler"].items():
        rank1 = results[1]["sampler"][(size, _shuffle, drop_last)]
        assert len(rank0) == len(rank1)
        if drop_last:
            assert set(rank0).isdisjoint(rank1)
            assert len(rank0) + len(rank1) == size - size % WORLD_SIZE
        elif size % WORLD_SIZE == 0:
            assert set(rank0).isdisjoint(rank1)
            assert set(rank0) | set(rank1) == set(range(size))
        else:
            # Uneven without drop_last: DistributedSampler pads by repeating indices.
            assert set(rank0) | set(rank1) == set(range(size))
            assert len(rank0) + len(rank1) == size + WORLD_SIZE - size % WORLD_SIZE


def _bitwise_all_reduce() -> dict[str, Any]:
    rank = dist.get_global_rank()
    out: dict[str, Any] = {}
    for op in ("BAND", "BOR", "BXOR"):
        for dtype in (torch.int64, torch.int32, torch.uint8):
            tensor = torch.tensor([6 + rank, 3 * rank, 12], dtype=dtype)  # rank 0: 6 0 12; rank 1: 7 3 12
            returned = dist.all_reduce(tensor, op.lower() if dtype is torch.int32 else op)
            out[op, str(dtype)] = (returned is tensor, tensor.tolist())
        flags = torch.tensor([True, rank == 1, False])
        out[op, "bool"] = dist.all_reduce(flags, op).tolist()
    with pytest.raises(TypeError, match="needs an integer or bool tensor"):
        dist.all_reduce(torch.ones(2), "BAND")
    with pytest.raises(ValueError, match="unknown operation"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), "NAND")
    dist.barrier()  # the refusals above happened on every rank without a collective
    return out


@pytest.mark.timeout(120)
def test_all_reduce_bitwise_operations_on_integer_and_bool_tensors() -> None:
    expected = {"BAND": [6, 0, 12], "BOR": [7, 3, 12], "BXOR": [1, 3, 0]}
    expected_bool = {"BAND": [True, False, False], "BOR": [True, True, False], "BXOR": [False, True, False]}
    for out in run_distributed(_bitwise_all_reduce, WORLD_SIZE, timeout=90):
        for op, values in expected.items():
            for dtype in ("torch.int64", "torch.int32", "torch.uint8"):
                assert out[op, dtype] == (True, values), (op, dtype)
            assert out[op, "bool"] == expected_bool[op]


def _small_objects() -> tuple[list[list[Any]], list[int]]:
    from lockstep import _agreement, dist
    rank = dist.get_global_rank()
    gathers, gather_rows = [], _agreement._gather_rows

    def counted(*args: Any) -> Any:
        gathers[-1] += 1
        return gather_rows(*args)

    _agreement._gather_rows = counted

    def gather(obj: Any) -> list[Any]:
        gathers.append(0)
        return _agreement.gather_small_objects(obj)

    small = {"rank": rank, "tensor": torch.arange(5) + rank}
    big = b"x" * (40_000 + rank)  # past the one-buffer size, and a different size per rank
    bigger = b"y" * (90_000 - rank)
    gathered = [gather(small), gather(big), gather(big), gather(None), gather(bigger), gather(bigger)]
    return gathered, gathers


@pytest.mark.timeout(120)
def test_gather_small_objects_returns_every_ranks_object_small_or_big() -> None:
    """Any size arrives; an object bigger than any before takes a second all-gather, and the next
    one that size only one."""
    for (small, big, big_again, nothing, bigger, bigger_again), gathers in run_distributed(
            _small_objects, world_size=2, timeout=100):
        assert [s["rank"] for s in small] == [0, 1]
        assert [s["tensor"].tolist() for s in small] == [[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]
        assert big == big_again == [b"x" * 40_000, b"x" * 40_001]
        assert nothing == [None, None]
        assert bigger == bigger_again == [b"y" * 90_000, b"y" * 89_999]
        assert gathers == [1, 2, 1, 1, 2, 1]


def _local_rank_zero_helpers(folder: str) -> dict[str, Any]:
    rank = dist.get_local_rank()
    marker = Path(folder) / "prepared.txt"
    with dist.run_local_rank_zero_first():
        if rank == 0:
            time.sleep(0.3)  # give rank 1 a chance to run first if the helper were broken
            marker.write_text("written by rank 0")
        seen_in_body = marker.read_text() if marker.exists() else None

    download = Path(folder) / "download.bin"
    if rank == 0:
        time.sleep(0.3)
        download.write_bytes(b"data")
    dist.local_rank_zero_download_and_wait(download, timeout=30)
    return {"seen_in_body": seen_in_body, "download": download.read_bytes()}


@pytest.mark.timeout(120)
def test_local_rank_zero_helpers(tmp_path: Path) -> None:
    results = run_distributed(_local_rank_zero_helpers, WORLD_SIZE, timeout=90, args=(str(tmp_path),))
    assert results == [{"seen_in_body": "written by rank 0", "download": b"data"}] * WORLD_SIZE


def _subgroups_and_sampler_replicas() -> dict[str, Any]:
    rank = dist.get_global_rank()
    # Every rank must create every group, in the same order; each rank then uses its own singleton.
    singletons = [torch_dist.new_group([0]), torch_dist.new_group([1])]
    both = torch_dist.new_group([0, 1])
    own, other = singletons[rank], singletons[1 - rank]
    out: dict[str, Any] = {
        "rank_in": (dist.get_global_rank(own), dist.get_global_rank(other), dist.get_global_rank(both)),
        "sum": dist.all_reduce(torch.tensor([rank + 1.0]), "SUM", group=own).tolist(),
        "avg": dist.all_reduce(torch.tensor([rank + 1.0]), "AVG", own).tolist(),
        "avg_both": dist.all_reduce(torch.tensor([rank + 1.0]), "AVG", group=both).tolist(),
        # src is a global rank: on rank 1 it is 1 although rank 1 is rank 0 of its group.
        "broadcast": dist.broadcast(torch.tensor([float(rank)]), src=rank, group=own).tolist(),
        "broadcast_both": dist.broadcast(torch.tensor([float(rank)]), 1, both).tolist(),
        "all_gather": [t.tolist() for t in dist.all_gather(torch.tensor([rank]), group=own)],
        "all_gather_both": [t.tolist() for t in dist.all_gather(torch.tensor([rank]), group=both)],
        "all_gather_object": dist.all_gather_object(f"r{rank}", group=own),
    }
    object_list: list[Any] = [f"from {rank}"]
    dist.broadcast_object_list(object_list=object_list, src=rank, group=own)
    out["broadcast_object_list"] = object_list
    object_list = [f"from {rank}"]
    dist.broadcast_object_list(object_list, 1, both)
    out["broadcast_object_list_both"] = object_list
    dist.barrier(group=own)
    dist.barrier(both)
    try:
        dist.all_reduce(torch.ones(1), group=other)
    except ValueError as e:
        out["non_member"] = str(e)

    data = list(range(10))
    out["samplers"] = {
        "default": list(dist.get_sampler(data)),
        "one_replica": list(dist.get_sampler(data, num_replicas=1, rank=0)),
        "four_replicas": list(dist.get_sampler(data, num_replicas=4, rank=2 * rank + 1)),
    }
    return out


@pytest.mark.timeout(120)
def test_collectives_on_subgroups_and_sampler_replicas() -> None:
    results = run_distributed(_subgroups_and_sampler_replicas, WORLD_SIZE, timeout=90)
    for rank, out in enumerate(results):
        assert out["rank_in"] == (0, -1, rank)
        assert out["sum"] == [rank + 1.0]  # its group is itself: no contribution from the other rank
        assert out["avg"] == [rank + 1.0]  # divided by the group's size, 1
        assert out["avg_both"] == [1.5]
        assert out["broadcast"] == [float(rank)]
        assert out["broadcast_both"] == [1.0]
        assert out["all_gather"] == [[rank]]
        assert out["all_gather_both"] == [[0], [1]]
        assert out["all_gather_object"] == [f"r{rank}"]
        assert out["broadcast_object_list"] == [f"from {rank}"]
        assert out["broadcast_object_list_both"] == ["from 1"]
        assert f"global rank {rank} is not a member of `group`" in out["non_member"]
        assert out["samplers"]["default"] == list(range(rank, 10, 2))  # unshuffled by default
        assert out["samplers"]["one_replica"] == list(range(10))
        # Replicas 1 and 3 of 4; 10 samples are padded to 12 by repeating indices 0 and 1.
        assert out["samplers"]["four_replicas"] == [[1, 5, 9], [3, 7, 1]][rank]


def _signal_files(folder: str) -> dict[str, Any]:
    rank = dist.get_global_rank()
    name = dist.get_node_signal_file_name(random.Random(rank))
    written = dist.write_signal_file(name, dir_path=Path(folder) / "written")
    dist.barrier()
    listed = sorted(os.listdir(Path(folder) / "written"))

    waits = Path(folder) / "waits"
    marker = Path(folder) / "rank0-body-done"
    with dist.busy_wait_for_local_rank_zero(dir_path=waits):
        if rank == 0:
            time.sleep(0.5)  # rank 1 would leave first if the helper did not wait
            marker.write_text("done")
    seen_after = marker.exists()
    dist.barrier()  # every rank has removed its node's signal file
    return {"name": name, "written": written, "listed": listed, "seen_after": seen_after,
            "left_over": sorted(os.listdir(waits))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local_world_size", [2, 1], ids=["one-node", "two-nodes-one-directory"])
def test_signal_file_helpers(tmp_path: Path, local_world_size: int) -> None:
    results = run_distributed(_signal_files, WORLD_SIZE, timeout=90, args=(str(tmp_path),),
                              local_world_size=local_world_size)
    token = "".join(random.Random(0).choices(string.ascii_letters + string.digits, k=6))  # rank 0's draw
    names = [f"._signal_file_node{rank // local_world_size}_{token}" for rank in range(WORLD_SIZE)]
    for rank, out in enumerate(results):
        assert out["name"] == names[rank]
        assert out["written"] == str(tmp_path / "written" / names[rank])
        assert out["listed"] == sorted(set(names))  # only local rank 0 wrote, once per node
        assert out["seen_after"] is True
        assert out["left_over"] == []


class _Boom(ValueError):
    pass


def _raise_on_rank_one() -> int:
    dist.barrier()  # rank 0 past its connections, so rank 1's exit fails nothing of rank 0's
    if dist.get_global_rank() == 1:
        raise _Boom("deliberate failure 7f3a")
    return 0


def _exit_on_rank_one() -> int:
    if dist.get_global_rank() == 1:
        os._exit(3)
    return 0


@pytest.mark.timeout(120)
def test_run_distributed_reraises_rank_traceback() -> None:
    with pytest.raises(RuntimeError) as info:
        run_distributed(_raise_on_rank_one, WORLD_SIZE, timeout=90)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "Traceback (most recent call last)" in message
    assert "in _raise_on_rank_one" in message
    assert "_Boom: deliberate failure 7f3a" in message
    assert "rank 0" not in message
    assert not multiprocessing.active_children()


@pytest.mark.timeout(120)
def test_run_distributed_reports_rank_that_died() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed: exited without reporting.*code 3"):
        run_distributed(_exit_on_rank_one, WORLD_SIZE, timeout=90)
    assert not multiprocessing.active_children()


def _hang_on_rank_one(folder: str) -> int:
    rank = dist.get_global_rank()
    (Path(folder) / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    return rank


@pytest.mark.timeout(60)
def test_run_distributed_timeout_kills_every_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 did not finish within 6 s"):
        run_distributed(_hang_on_rank_one, WORLD_SIZE, timeout=6, args=(str(tmp_path),))
    assert time.monotonic() - start < 20
    assert not multiprocessing.active_children()
    for rank in range(WORLD_SIZE):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- initialize_dist through env:// in plain subprocesses, as a launched script would use it ---------

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from lockstep import dist

    dist.initialize_dist("cpu", timeout=60)
    total = dist.all_reduce(torch.tensor([dist.get_global_rank() + 1.0]), "SUM")
    print(f"rank {dist.get_global_rank()} total {total.item()}")
    if sys.argv[1] == "fail" and dist.get_global_rank() == 1:
        raise RuntimeError("rank 1 fails after a collective")
    if sys.argv[1] == "fail":
        dist.barrier()  # rank 1 never arrives; rank 0 must error out, not hang
    # No destroy_process_group here: lockstep's atexit handler must tear the group down.
    """
)


def _launch_two_ranks(mode: str, timeout: float) -> list[subprocess.CompletedProcess[str]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _SCRIPT, mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
        return results
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_initialize_dist_env_rendezvous_and_clean_exit() -> None:
    results = _launch_two_ranks("ok", timeout=90)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}: {result.returncode}\n{result.stderr}"
        assert f"rank {rank} total 3.0" in result.stdout


@pytest.mark.timeout(120)
def test_initialize_dist_exit_after_exception_does_not_hang() -> None:
    results = _launch_two_ranks("fail", timeout=90)
    assert results[1].returncode == 1, results[1].stderr
    assert "rank 1 fails after a collective" in results[1].stderr
    assert results[0].returncode != 0, results[0].stderr


@pytest.mark.timeout(120)
def test_initialize_dist_takes_a_device_object_as_composer_does(tmp_path: Path) -> None:
    """Composer's two-process tests start with ``dist.initialize_dist(DeviceCPU())``."""
    script = tmp_path / "init.py"
    script.write_text(textwrap.dedent("""
        import torch
        from lockstep.devices import DeviceCPU
        from lockstep.utils import dist
        dist.initialize_dist(DeviceCPU(), timeout=60)
        total = torch.tensor([dist.get_global_rank() + 1.0])
        dist.all_reduce(total)
        print("sum", dist.get_global_rank(), torch.distributed.get_backend(), float(total[0]))
    """))
    out = subprocess.run([sys.executable, "-m", "lockstep", "-n", "2", "--stdout", str(tmp_path / "rank{rank}.out"),
                          str(script)], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    said = (tmp_path / "rank1.out").read_text() if (tmp_path / "rank1.out").exists() else ""
    assert "sum 0 gloo 3.0" in out.stdout and "sum 1 gloo 3.0" in said


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_is_named(tmp_path: Path) -> None:
    """Issue 53: torch's 'wait timeout after 5000ms, keys: /default_pg/0//cpu//0/1' becomes one
    line naming the rank (and node) that never came."""
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent("""
        import os, time
        from lockstep import dist
        if os.environ["RANK"] == "1":
            time.sleep(30)
        dist.initialize_dist("cpu", timeout=3)
    """))
    out = subprocess.run([sys.executable, "-m", "lockstep", "-n", "2", str(script)], capture_output=True, text=True,
                         timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    assert "DistStoreError: rank 1 (node 0) did not join the process group" in out.stderr, out.stderr[-2000:]
    assert "within 3 s (dist_timeout), seen from rank 0 at 127.0.0.1:" in out.stderr
