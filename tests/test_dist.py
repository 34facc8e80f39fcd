"""Single-process tests of lockstep.dist: defaults, env validation, world-size-1 collectives."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist

from lockstep import dist

_CONTRACT = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in _CONTRACT:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def _set_env(monkeypatch: pytest.MonkeyPatch, **values: int | str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def test_defaults_without_env() -> None:
    assert dist.is_available()
    assert not dist.is_initialized()
    assert dist.get_world_size() == 1
    assert dist.get_global_rank() == 0
    assert dist.get_local_rank() == 0
    assert dist.get_local_world_size() == 1
    assert dist.get_node_rank() == 0


def test_getters_read_env_contract(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, NODE_RANK=1)
    assert dist.get_world_size() == 8
    assert dist.get_global_rank() == 5
    assert dist.get_local_rank() == 1
    assert dist.get_local_world_size() == 4
    assert dist.get_node_rank() == 1


def test_node_rank_fallbacks(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    assert dist.get_node_rank() == 0  # single node: inferred
    clean_env.setenv("GROUP_RANK", "0")  # torchrun's name
    assert dist.get_node_rank() == 0
    clean_env.delenv("GROUP_RANK")
    _set_env(clean_env, WORLD_SIZE=4, RANK=3)
    with pytest.raises(ValueError, match="NODE_RANK is not set"):
        dist.get_node_rank()


@pytest.mark.parametrize(
    ("env", "getter", "pattern"),
    [
        ({"WORLD_SIZE": 2}, dist.get_global_rank, r"WORLD_SIZE=2 but environment variable RANK is not set"),
        ({"WORLD_SIZE": 2, "RANK": 1}, dist.get_local_rank, "LOCAL_RANK is not set"),
        ({"WORLD_SIZE": 2, "RANK": 1}, dist.get_local_world_size, "LOCAL_WORLD_SIZE is not set"),
        ({"WORLD_SIZE": 2, "RANK": "one"}, dist.get_global_rank, r"RANK='one' is not an integer"),
        ({"WORLD_SIZE": "two"}, dist.get_world_size, r"WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": 2, "LOCAL_RANK": "x"}, dist.get_local_rank, "LOCAL_RANK='x'"),
        ({"WORLD_SIZE": 0}, dist.get_world_size, "WORLD_SIZE=0 must be at least 1"),
        ({"WORLD_SIZE": 2, "RANK": 2}, dist.get_global_rank, r"RANK=2 is out of range"),
        ({"RANK": 1}, dist.get_global_rank, "RANK=1 is set but WORLD_SIZE is not"),
        (
            {"WORLD_SIZE": 4, "LOCAL_RANK": 2, "LOCAL_WORLD_SIZE": 2},
            dist.get_local_rank,
            "LOCAL_RANK=2 is out of range",
        ),
        ({"WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 3}, dist.get_local_world_size, "LOCAL_WORLD_SIZE=3"),
    ],
)
def test_inconsistent_env_names_the_variable(
    clean_env: pytest.MonkeyPatch, env: dict[str, int | str], getter: object, pattern: str
) -> None:
    _set_env(clean_env, **env)
    with pytest.raises(ValueError, match=pattern):
        getter()  # type: ignore[operator]


def test_missing_variable_message_says_how_to_fix(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, WORLD_SIZE=2)
    with pytest.raises(ValueError, match=r"lockstep -n N script\.py"):
        dist.get_global_rank()


def test_collectives_are_noops_at_world_size_one() -> None:
    tensor = torch.tensor([1.0, -2.0, 3.0])
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "avg"):
        assert dist.all_reduce(tensor, op) is tensor
        assert tensor.tolist() == [1.0, -2.0, 3.0]
    assert dist.broadcast(tensor, src=0) is tensor
    gathered = dist.all_gather(tensor)
    assert len(gathered) == 1 and gathered[0] is tensor
    assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
    objs = ["x", 2]
    assert dist.broadcast_object_list(objs) is None
    assert objs == ["x", 2]
    dist.barrier()


def test_all_reduce_argument_errors() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        dist.all_reduce(torch.tensor([1, 2]), "AVG")
    with pytest.raises(ValueError, match="SUM, PRODUCT, MIN, MAX, AVG"):
        dist.all_reduce(torch.tensor([1.0]), "MEAN")
    with pytest.raises(TypeError, match="as a string"):
        dist.all_reduce(torch.tensor([1.0]), torch_dist.ReduceOp.SUM)  # type: ignore[arg-type]
    assert dist.all_reduce(torch.tensor([1, 2]), "SUM").tolist() == [1, 2]


def test_broadcast_src_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"src must be in \[0, 1\)"):
        dist.broadcast(torch.zeros(1), src=1)
    with pytest.raises(TypeError, match="needs a list"):
        dist.broadcast_object_list(("a",))  # type: ignore[arg-type]


def test_collectives_refuse_without_process_group_when_env_says_distributed(
    clean_env: pytest.MonkeyPatch,
) -> None:
    _set_env(clean_env, RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2)
    calls = [
        lambda: dist.all_reduce(torch.ones(1)),
        lambda: dist.broadcast(torch.ones(1), 0),
        lambda: dist.all_gather(torch.ones(1)),
        lambda: dist.all_gather_object(1),
        lambda: dist.broadcast_object_list([1]),
        dist.barrier,
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"Call `lockstep\.dist\.initialize_dist\(\)` first"):
            call()
    with pytest.raises(RuntimeError, match="initialize_dist"):
        with dist.run_local_rank_zero_first():
            pass


def test_get_sampler_world_size_one() -> None:
    dataset = list(range(10))
    sampler = dist.get_sampler(dataset, shuffle=False)
    assert isinstance(sampler, torch.utils.data.DistributedSampler)
    assert list(sampler) == dataset
    assert sorted(dist.get_sampler(dataset, seed=3)) == dataset


def test_get_sampler_uses_env_rank_without_process_group(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    sampler = dist.get_sampler(list(range(6)), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert list(sampler) == [1, 3, 5]


def test_initialize_dist_world_size_one_is_noop() -> None:
    dist.initialize_dist()
    dist.initialize_dist("cpu")
    assert not dist.is_initialized()


def test_initialize_dist_needs_master_addr_and_port(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2)
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set.*lockstep -n N script\.py"):
        dist.initialize_dist("cpu")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        dist.initialize_dist("cpu")
    assert not dist.is_initialized()


def test_initialize_dist_argument_errors() -> None:
    with pytest.raises(ValueError, match="unsupported device"):
        dist.initialize_dist("tpu")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        dist.initialize_dist("cpu", timeout=0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_initialize_dist_single_rank_with_master_addr(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    dist.initialize_dist("cpu", timeout=30)
    assert dist.is_initialized()
    assert torch_dist.get_backend() == "gloo"
    dist.initialize_dist("cpu")  # already initialized: no-op
    dist.initialize_dist()
    with pytest.raises(RuntimeError, match="already initialized with 'gloo'"):
        dist.initialize_dist("gpu")
    assert dist.all_reduce(torch.tensor([3.0]), "AVG").item() == 3.0


def test_local_rank_zero_helpers_at_world_size_one(tmp_path: Path) -> None:
    ran = []
    with dist.run_local_rank_zero_first():
        ran.append(True)
    assert ran == [True]
    dist.local_rank_zero_download_and_wait(tmp_path / "never-created", timeout=0.01)


def test_download_and_wait_on_non_zero_local_rank(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _set_env(clean_env, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    existing = tmp_path / "data.bin"
    existing.write_bytes(b"x")
    dist.local_rank_zero_download_and_wait(existing, timeout=0.01)
    with pytest.raises(TimeoutError, match="Local rank 1 waited"):
        dist.local_rank_zero_download_and_wait(tmp_path / "missing.bin", timeout=0.2)
