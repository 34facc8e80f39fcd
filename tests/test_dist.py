"""Single-process tests of lockstep.dist: defaults, env validation, world-size-1 collectives."""

from __future__ import annotations

import inspect
import math
import random
import string
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist

from lockstep import dist
from tests.helpers import free_port

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


@pytest.mark.parametrize(
    ("env", "getter", "name"),
    [
        ({"WORLD_SIZE": 2}, dist.get_global_rank, "RANK"),
        ({"RANK": 1}, dist.get_global_rank, "WORLD_SIZE"),
        ({"WORLD_SIZE": 2, "RANK": 1}, dist.get_local_rank, "LOCAL_RANK"),
        ({"WORLD_SIZE": 2, "RANK": 1}, dist.get_local_world_size, "LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": 4, "RANK": 3, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2}, dist.get_node_rank, "NODE_RANK"),
        ({"WORLD_SIZE": 2, "RANK": 0, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 2}, dist.initialize_dist, "MASTER_ADDR"),
    ],
)
def test_missing_variable_raises_missing_environment_error(
    clean_env: pytest.MonkeyPatch, env: dict[str, int], getter: object, name: str
) -> None:
    _set_env(clean_env, **env)
    with pytest.raises(dist.MissingEnvironmentError, match=rf"\b{name} is not\b") as info:
        getter()  # type: ignore[operator]
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_malformed_variable_is_not_a_missing_environment_error(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, WORLD_SIZE=2, RANK="one")
    with pytest.raises(ValueError) as info:
        dist.get_global_rank()
    assert not isinstance(info.value, dist.MissingEnvironmentError)


# Composer's public names, parameters and defaults (composer/utils/dist.py), which ported code relies on.
_COMPOSER_SIGNATURES = {
    "get_world_size": [],
    "get_global_rank": [("group", None)],
    "get_local_rank": [],
    "get_local_world_size": [],
    "get_node_rank": [],
    "is_available": [],
    "is_initialized": [],
    "initialize_dist": [("device", None), ("timeout", 300.0)],
    "barrier": [("group", None)],
    "all_reduce": [("tensor", inspect.Parameter.empty), ("reduce_operation", "SUM"), ("group", None)],
    "broadcast": [("tensor", inspect.Parameter.empty), ("src", inspect.Parameter.empty), ("group", None)],
    "broadcast_object_list": [("object_list", inspect.Parameter.empty), ("src", 0), ("group", None)],
    "all_gather": [("tensor", inspect.Parameter.empty), ("group", None)],
    "all_gather_object": [("obj", inspect.Parameter.empty), ("group", None)],
    "get_sampler": [("dataset", inspect.Parameter.empty), ("drop_last", False), ("shuffle", False),
                    ("num_replicas", None), ("rank", None), ("seed", 0)],
    "run_local_rank_zero_first": [],
    "local_rank_zero_download_and_wait": [("expected_file_path", inspect.Parameter.empty)],
    "get_node_signal_file_name": [("rng", None)],
    "write_signal_file": [("signal_file_name", inspect.Parameter.empty), ("dir_path", None)],
    "busy_wait_for_local_rank_zero": [("dir_path", None)],
}


@pytest.mark.parametrize("name", sorted(_COMPOSER_SIGNATURES))
def test_composer_names_parameters_and_defaults(name: str) -> None:
    assert name in dist.__all__
    params = inspect.signature(getattr(dist, name)).parameters
    # Composer's parameters come first, by the same names; lockstep's extras are keyword-only.
    expected = _COMPOSER_SIGNATURES[name]
    assert [(p.name, p.default) for p in list(params.values())[: len(expected)]] == expected
    extras = list(params.values())[len(expected):]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras), extras


def test_collectives_with_group_none_are_noops_at_world_size_one() -> None:
    tensor = torch.tensor([2.0])
    assert dist.all_reduce(tensor, "AVG", group=None) is tensor
    assert dist.broadcast(tensor, 0, group=None) is tensor
    assert dist.all_gather(tensor, group=None)[0] is tensor
    assert dist.all_gather_object("x", group=None) == ["x"]
    object_list = ["a"]
    dist.broadcast_object_list(object_list=object_list, src=0, group=None)
    assert object_list == ["a"]
    dist.barrier(group=None)
    assert dist.get_global_rank(group=None) == 0
    assert tensor.tolist() == [2.0]


def test_collectives_are_noops_at_world_size_one() -> None:
    tensor = torch.tensor([1.0, -2.0, 3.0])
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "avg"):
        assert dist.all_reduce(tensor, op) is tensor
        assert tensor.tolist() == [1.0, -2.0, 3.0]
    bits = torch.tensor([6, 3])
    for op in ("BAND", "BOR", "BXOR", "bxor"):
        assert dist.all_reduce(bits, op) is bits
        assert bits.tolist() == [6, 3]
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
    with pytest.raises(ValueError, match=r"'MEAN'\): unknown operation; valid names are SUM, PRODUCT, MIN, MAX, "
                                         r"BAND, BOR, BXOR, AVG\.$"):
        dist.all_reduce(torch.tensor([1.0]), "MEAN")
    with pytest.raises(ValueError, match="unknown operation"):
        dist.all_reduce(torch.tensor([1]), "PREMUL_SUM")  # a torch ReduceOp, but it needs a factor
    for op in ("BAND", "bor", "BXOR"):
        with pytest.raises(TypeError, match=f"reduce_operation='{op.upper()}'\\) needs an integer or bool tensor, "
                                            "got torch.float32"):
            dist.all_reduce(torch.tensor([1.0]), op)
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
    sampler = dist.get_sampler(dataset)
    assert isinstance(sampler, torch.utils.data.DistributedSampler)
    assert (sampler.shuffle, sampler.drop_last, sampler.num_replicas, sampler.rank) == (False, False, 1, 0)
    assert list(sampler) == dataset  # Composer's default: no shuffling
    shuffled = list(dist.get_sampler(dataset, shuffle=True, seed=3))
    assert sorted(shuffled) == dataset and shuffled != dataset


def test_get_sampler_explicit_replicas_and_rank(clean_env: pytest.MonkeyPatch) -> None:
    dataset = list(range(10))
    assert list(dist.get_sampler(dataset, num_replicas=3, rank=2)) == [2, 5, 8, 1]  # padded to 12
    assert list(dist.get_sampler(dataset, num_replicas=3, rank=2, drop_last=True)) == [2, 5, 8]
    with pytest.raises(ValueError, match="rank"):
        dist.get_sampler(dataset, num_replicas=2, rank=2)
    # Explicit values win over the environment, and an incomplete environment is then not read.
    _set_env(clean_env, WORLD_SIZE=4)
    assert list(dist.get_sampler(dataset, num_replicas=2, rank=1)) == [1, 3, 5, 7, 9]


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


@pytest.mark.timeout(60)
def test_initialize_dist_single_rank_with_master_addr(clean_env: pytest.MonkeyPatch) -> None:
    _set_env(clean_env, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
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
    # Composer's form: a context manager.
    with dist.local_rank_zero_download_and_wait(expected_file_path=tmp_path / "never-created"):
        ran.append(True)
    assert ran == [True, True]


def test_download_and_wait_on_non_zero_local_rank(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _set_env(clean_env, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    existing = tmp_path / "data.bin"
    existing.write_bytes(b"x")
    dist.local_rank_zero_download_and_wait(existing, timeout=0.01)
    with dist.local_rank_zero_download_and_wait(existing, timeout=0.01):
        pass
    with pytest.raises(TimeoutError, match="Local rank 1 waited"):
        dist.local_rank_zero_download_and_wait(tmp_path / "missing.bin", timeout=0.2)
    with pytest.raises(TimeoutError, match="Local rank 1 waited"):
        with dist.local_rank_zero_download_and_wait(tmp_path / "missing.bin", timeout=0.2):
            pytest.fail("the body must not run before the file exists")


def test_download_and_wait_has_no_time_limit_by_default_as_in_composer() -> None:
    params = inspect.signature(dist.local_rank_zero_download_and_wait).parameters
    assert params["timeout"].default == math.inf


def test_download_and_wait_warns_once_while_it_keeps_waiting(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _set_env(clean_env, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    clean_env.setattr(dist, "_SLOW_WAIT_WARNING", 0.05)
    late = tmp_path / "late.bin"
    writer = threading.Timer(0.5, late.write_bytes, args=(b"x",))
    writer.start()
    try:
        with pytest.warns(UserWarning, match=r"Local rank 1 has waited \d+ s for .*late\.bin.*goes on waiting") as seen:
            dist.local_rank_zero_download_and_wait(late, poll_interval=0.01)
    finally:
        writer.cancel()
    assert late.exists()
    # once, however long it waits (other warnings the block caught, such as a ResourceWarning of
    # something collected meanwhile on a loaded machine, are not this one)
    assert len([w for w in seen if "goes on waiting" in str(w.message)]) == 1, [str(w.message) for w in seen]


def _token(seed: int) -> str:
    return "".join(random.Random(seed).choices(string.ascii_letters + string.digits, k=6))


def test_signal_file_helpers_at_world_size_one(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert dist.get_node_signal_file_name(random.Random(5)) == f"._signal_file_node0_{_token(5)}"
    assert dist.get_node_signal_file_name() != dist.get_node_signal_file_name()

    folder = tmp_path / "new" / "dir"
    path = dist.write_signal_file("signal", dir_path=folder)
    assert path == str(folder / "signal") and (folder / "signal").is_file()
    clean_env.chdir(tmp_path)
    assert dist.write_signal_file("here") == str(tmp_path / "here")
    assert (tmp_path / "here").is_file()

    ran = []
    with dist.busy_wait_for_local_rank_zero(dir_path=folder):
        ran.append(True)
    assert ran == [True]
    assert sorted(p.name for p in folder.iterdir()) == ["signal"]  # its own signal file is removed


def test_write_signal_file_only_on_local_rank_zero(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _set_env(clean_env, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2)
    assert dist.write_signal_file("signal", tmp_path / "d") == str(tmp_path / "d" / "signal")
    assert (tmp_path / "d").is_dir() and not (tmp_path / "d" / "signal").exists()


def test_signal_helpers_refuse_without_process_group_when_env_says_distributed(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _set_env(clean_env, RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2)
    with pytest.raises(RuntimeError, match="initialize_dist"):
        dist.get_node_signal_file_name()
    with pytest.raises(RuntimeError, match="initialize_dist"):
        with dist.busy_wait_for_local_rank_zero(tmp_path):
            pytest.fail("the body must not run")


def test_the_work_of_an_asynchronous_collective_is_waited_for_in_torch_or_through_the_waiter() -> None:
    waited = []

    class Work:
        def wait(self) -> None:
            waited.append("torch")

    dist.wait_collective(Work())
    dist.set_collective_waiter(lambda work: waited.append(f"waiter: {type(work).__name__}"))
    try:
        dist.wait_collective(Work())
    finally:
        dist.set_collective_waiter(None)
    assert waited == ["torch", "waiter: Work"]
