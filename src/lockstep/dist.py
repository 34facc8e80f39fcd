"""Rank helpers and collectives that behave the same inside and outside a distributed run.

Names and signatures are ``composer.utils.dist``'s, so code ported from Composer runs after renaming
the import.

Outside a run (none of the launcher's environment variables set) the getters report world size 1 and
rank 0, and every collective is a no-op that returns its input, so user code needs no
``if distributed:`` branches. Inside a run the getters read the environment contract set by the
``lockstep`` launcher (and by torchrun): ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK``;
once a process group exists, torch.distributed's own world size and rank take precedence. An
inconsistent environment (say WORLD_SIZE=2 and no RANK) raises :class:`MissingEnvironmentError`
naming the missing variable.

Collectives take ``group=None`` (the default group) or a group made by
``torch.distributed.new_group``. With a group, sizes and ranks are the group's, as in
torch.distributed; ``src`` stays a global rank; only the group's members may call them.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import pickle
import random
import re
import string
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

dist = torch_dist
"""``torch.distributed``, under the name Composer's ``composer.utils.dist`` gives it."""
from torch.utils.data import Dataset, DistributedSampler

from lockstep import regroup
from lockstep.progress import heartbeat, heartbeat_paused

__all__ = [
    "MissingEnvironmentError",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "busy_wait_for_local_rank_zero",
    "gather_object",
    "get_global_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_node_signal_file_name",
    "get_sampler",
    "get_world_size",
    "heartbeat",
    "heartbeat_paused",
    "initialize_dist",
    "is_available",
    "is_initialized",
    "local_rank_zero_download_and_wait",
    "run_collective",
    "run_local_rank_zero_first",
    "scatter_object",
    "wait_collective",
    "write_signal_file",
]

T = TypeVar("T")

_LAUNCH_HINT = "Launch the script with `lockstep -n N script.py`, which sets it, or export it yourself."
_VAR_MEANING = {
    "RANK": "the global rank of this process (0 .. WORLD_SIZE-1)",
    "WORLD_SIZE": "the total number of processes",
    "LOCAL_RANK": "the rank of this process on its node (0 .. LOCAL_WORLD_SIZE-1)",
    "LOCAL_WORLD_SIZE": "the number of processes on this node",
    "NODE_RANK": "the index of this node",
    "MASTER_ADDR": "the address of the host that runs rank 0",
    "MASTER_PORT": "a free TCP port on the host that runs rank 0",
}
_BITWISE_OPS = ("BAND", "BOR", "BXOR")
_REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", *_BITWISE_OPS, "AVG")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# A wait for local rank 0's file this long is worth a word (a wrong path would otherwise hang silently).
_SLOW_WAIT_WARNING = 300.0
_atexit_registered = False


# ----------------------------------------------------------------------------- environment contract


class MissingEnvironmentError(ValueError):
    """A variable of the environment contract is missing although the others say the run is distributed.

    The message names the variable and what it means. Composer's class of the same name derives from
    Exception; this one derives from ValueError so that ``except ValueError`` still catches it.
    """


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name}={os.environ[name]!r} is not an integer; {name} must be "
            f"{_VAR_MEANING.get(name, 'an integer')}. Unset it or set it to an integer."
        ) from None


def _missing(name: str, world_size: int) -> MissingEnvironmentError:
    return MissingEnvironmentError(
        f"WORLD_SIZE={world_size} but environment variable {name} is not set; {name} is "
        f"{_VAR_MEANING[name]}. {_LAUNCH_HINT}"
    )


def _out_of_range(name: str, value: int, bound_name: str, bound: int) -> ValueError:
    return ValueError(
        f"Environment variable {name}={value} is out of range: it must be in [0, {bound}) because "
        f"{bound_name}={bound}. Fix {name} or {bound_name}."
    )


def _env_world_size() -> int:
    world_size = _env_int("WORLD_SIZE")
    if world_size is None:
        return 1
    if world_size < 1:
        raise ValueError(f"Environment variable WORLD_SIZE={world_size} must be at least 1.")
    return world_size


def is_available() -> bool:
    """Return True if this torch build supports torch.distributed."""
    return torch_dist.is_available()


def is_initialized() -> bool:
    """Return True if the default torch.distributed process group exists."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_world_size() -> int:
    """Return the number of processes in the run (1 outside a distributed run)."""
    if is_initialized():
        return torch_dist.get_world_size()
    return _env_world_size()


def get_global_rank(group: torch_dist.ProcessGroup | None = None) -> int:
    """Return this process's rank among all processes (0 outside a distributed run).

    With ``group``, return its rank within that group (torch.distributed's ``get_rank(group)``),
    -1 if it is not a member, as Composer does.
    """
    if group is not None:
        return torch_dist.get_rank(group)
    if is_initialized():
        return torch_dist.get_rank()
    world_size = _env_world_size()
    rank = _env_int("RANK")
    if rank is None:
        if world_size > 1:
            raise _missing("RANK", world_size)
        return 0
    if "WORLD_SIZE" not in os.environ and rank != 0:
        raise MissingEnvironmentError(
            f"RANK={rank} is set but WORLD_SIZE is not; WORLD_SIZE is {_VAR_MEANING['WORLD_SIZE']}. "
            f"{_LAUNCH_HINT}"
        )
    if not 0 <= rank < world_size:
        raise _out_of_range("RANK", rank, "WORLD_SIZE", world_size)
    return rank


_local_world_size_now: int | None = None
"""This node's ranks that train now, in an elastic job whose ranks changed (:func:`set_local_world_size`)."""


def set_local_world_size(ranks: int | None) -> None:
    """Have :func:`get_local_world_size` return ``ranks``: an elastic job's membership tells how
    many of this node's ranks train after a change, which the launch's ``LOCAL_WORLD_SIZE`` no
    longer says (``LOCAL_RANK`` stays the rank's device index)."""
    global _local_world_size_now
    _local_world_size_now = ranks


def get_local_world_size() -> int:
    """Return the number of processes on this node (1 outside a distributed run)."""
    if _local_world_size_now is not None:
        return _local_world_size_now
    local_world_size = _env_int("LOCAL_WORLD_SIZE")
    world_size = get_world_size()
    if local_world_size is None:
        if world_size > 1:
            raise _missing("LOCAL_WORLD_SIZE", world_size)
        return 1
    if not 1 <= local_world_size <= world_size:
        raise ValueError(
            f"Environment variable LOCAL_WORLD_SIZE={local_world_size} must be in [1, WORLD_SIZE] "
            f"and WORLD_SIZE={world_size}. Fix LOCAL_WORLD_SIZE or WORLD_SIZE."
        )
    return local_world_size


def get_local_rank() -> int:
    """Return this process's rank on its node (0 outside a distributed run)."""
    local_rank = _env_int("LOCAL_RANK")
    if local_rank is None:
        world_size = get_world_size()
        if world_size > 1:
            raise _missing("LOCAL_RANK", world_size)
        return 0
    local_world_size = _env_int("LOCAL_WORLD_SIZE")
    bound, bound_name = (
        (local_world_size, "LOCAL_WORLD_SIZE")
        if local_world_size is not None
        else (get_world_size(), "WORLD_SIZE")
    )
    if not 0 <= local_rank < bound:
        raise _out_of_range("LOCAL_RANK", local_rank, bound_name, bound)
    return local_rank


def get_node_rank() -> int:
    """Return the index of this node (0 outside a distributed run).

    Reads ``NODE_RANK``, then torchrun's ``GROUP_RANK``; on a single node (world size equal to the
    local world size) it is 0 even when neither is set.
    """
    for name in ("NODE_RANK", "GROUP_RANK"):
        node_rank = _env_int(name)
        if node_rank is not None:
            if node_rank < 0:
                raise ValueError(f"Environment variable {name}={node_rank} must be >= 0.")
            return node_rank
    world_size = get_world_size()
    if world_size == 1 or get_local_world_size() == world_size:
        return 0
    raise _missing("NODE_RANK", world_size)


# ----------------------------------------------------------------------------- process group


def _backend_for(device: Any) -> str:
    device = getattr(device, "torch_device", device)  # a lockstep.devices.Device (Composer passes DeviceCPU())
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    device_type = "cuda" if device_type == "gpu" else device_type
    if device_type not in _BACKENDS:
        raise ValueError(
            f"initialize_dist(device={device!r}): unsupported device; use None, 'cpu', 'gpu' or 'cuda'."
        )
    return _BACKENDS[device_type]


def _destroy_at_exit() -> None:
    # torch 2.13 + gloo: exiting right after a collective without destroy_process_group can abort
    # with SIGABRT during interpreter shutdown. So can exiting with the group destroyed but still
    # referenced, by a DDP module's reducer in a reference cycle, say: then it is torn down in the
    # interpreter's finalization (under torchrun, 1 exit in 5 of a DDP loop). Collecting the cycles
    # here frees it while Python is still whole. No barrier here: if this rank is exiting because of
    # an exception, its peers may never reach one, and exit must not hang.
    if is_initialized():
        with contextlib.suppress(Exception):
            torch_dist.destroy_process_group()
        gc.collect()


def _check_existing_backend(device: Any, backend: str) -> None:
    existing = str(torch_dist.get_backend())
    if device is not None and backend not in existing:
        raise RuntimeError(
            f"initialize_dist(device={device!r}) needs the {backend} backend, but the process group is "
            f"already initialized with {existing!r}. Pass a matching device, or create the group with "
            f"backend={backend!r}."
        )


def _require_rendezvous_env(world_size: int) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise MissingEnvironmentError(
                f"initialize_dist(): WORLD_SIZE={world_size} but environment variable {name} is not "
                f"set; {name} is {_VAR_MEANING[name]}. {_LAUNCH_HINT}"
            )


def initialize_dist(device: Any = None, timeout: float = 300.0, *,
                    single_process_group: bool = False) -> None:
    """Create the default process group from the environment contract, if one is needed.

    ``device`` picks the backend: ``'cpu'`` or ``DeviceCPU()`` -> gloo, ``'gpu'``/``'cuda'`` or
    ``DeviceGPU()`` (any :class:`lockstep.devices.Device`, or a ``torch.device``) -> nccl; None picks nccl
    when CUDA is available, else gloo. With world size 1 and no ``MASTER_ADDR`` this is a no-op, and so
    it is when a process group already exists (whose backend must then suit ``device``). The group is
    destroyed when the interpreter exits. ``timeout`` (seconds) bounds rendezvous and collectives.
    ``single_process_group`` makes a 1-rank group even then, with an in-memory store (FSDP needs a
    group at any world size).
    """
    if timeout <= 0:
        raise ValueError(f"initialize_dist(timeout={timeout!r}): timeout must be > 0 seconds.")
    backend = _backend_for(device)
    if is_initialized():
        _check_existing_backend(device, backend)
        return
    if regroup.joining():  # a node's launcher rejoined a running elastic job: its newest ranks' group
        regroup.enter(timeout)
        _register_destroy_at_exit()
        return
    if regroup.starting():  # an elastic job started without some nodes: the group of the ranks there are
        regroup.start(timeout)
        _register_destroy_at_exit()
        return
    world_size, rank = get_world_size(), get_global_rank()
    if world_size == 1 and not os.environ.get("MASTER_ADDR"):
        if not single_process_group:
            return
        if backend == "nccl":
            torch.cuda.set_device(get_local_rank())
        torch_dist.init_process_group(backend, store=torch_dist.HashStore(), world_size=1, rank=0,
                                      timeout=timedelta(seconds=timeout))
        _register_destroy_at_exit()
        return
    _require_rendezvous_env(world_size)
    _rendezvous(device, backend, world_size, rank, timeout)
    _register_destroy_at_exit()


def _rendezvous(device: Any, backend: str, world_size: int, rank: int, timeout: float) -> None:
    """The default process group through the ``env://`` rendezvous, naming the ranks that never came."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"initialize_dist(device={device!r}) needs CUDA, but torch.cuda.is_available() is "
                "False. Use device='cpu'."
            )
        torch.cuda.set_device(get_local_rank())
    try:
        store, rank, world_size = next(torch_dist.rendezvous("env://", rank, world_size,
                                                             timeout=timedelta(seconds=timeout)))
        torch_dist.init_process_group(backend, store=_fresh_keys(store, rank), world_size=world_size, rank=rank,
                                      timeout=timedelta(seconds=timeout))
    except torch_dist.DistStoreError as e:
        missing = ranks_waited_for(str(e))
        if not missing:
            raise
        raise torch_dist.DistStoreError(_not_joined(missing, timeout)) from None


def _fresh_keys(store: Any, rank: int) -> Any:
    """``store`` under a prefix of its own for this rank's n-th default group of this attempt. The
    launcher's store outlives a group destroyed before (mosaicml-streaming's ``StreamingDataset``
    makes one and destroys it when no group exists yet), and torch names a new default group's keys
    as it named that one's: ranks would read each other's old addresses and fail to connect
    ("connectFullMesh failed ... Connection refused"; under torchrun too). Every rank of a job makes
    the same groups, so each counts the same n."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    made = store.add(f"lockstep/default_groups/{attempt}/{rank}", 1)
    return torch_dist.PrefixStore(f"lockstep/default_group/{attempt}/{made}/", store)


def ranks_waited_for(error: str) -> list[int]:
    """The ranks a process-group store timeout waited for, from torch's message (``wait timeout
    after 20000ms, keys: /default_pg/0//cpu//0/1``: each key ends in the rank whose address it is)."""
    _, found, keys = error.partition("keys: ")
    if not found:
        return []
    return sorted({int(m) for m in re.findall(r"/(\d+)(?=[,\]\s]|$)", keys)})


def _not_joined(missing: list[int], timeout: float) -> str:
    """One line naming the ranks (and, with one node size, the nodes) that never joined."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    names = [f"rank {r}" + (f" (node {r // local})" if local > 0 else "") for r in missing]
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return (f"{', '.join(names)} did not join the process group (lockstep.dist.initialize_dist, which "
            f"Trainer(...) calls) within {timeout:g} s (dist_timeout), seen from rank {get_global_rank()} at "
            f"{where}: {'it' if len(missing) == 1 else 'they'} started late, stopped before it, or exited "
            f"(see {'its' if len(missing) == 1 else 'their'} output)")


def _register_destroy_at_exit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_destroy_at_exit)
        _atexit_registered = True


def _group_ready(caller: str, group: torch_dist.ProcessGroup | None = None) -> bool:
    """True if a collective must really communicate; False at world size 1; raise if misconfigured."""
    if is_initialized():
        # torch.distributed only warns on a non-member and skips the collective, which would leave
        # all_gather's output as uninitialized placeholders: refuse instead.
        if group is not None and torch_dist.get_rank(group) < 0:
            raise ValueError(
                f"lockstep.dist.{caller}(group=...): global rank {torch_dist.get_rank()} is not a member "
                "of `group`. Call it only on the group's members (where `get_global_rank(group) >= 0`)."
            )
        return True
    world_size = get_world_size()
    if world_size > 1:
        raise RuntimeError(
            f"lockstep.dist.{caller}() needs a process group: WORLD_SIZE={world_size} but "
            "the distributed package is not available or has not been initialized. Call "
            "`lockstep.dist.initialize_dist()` first."
        )
    return False


def _check_src(src: int, caller: str) -> None:
    world_size = get_world_size()
    if not 0 <= src < world_size:
        raise ValueError(f"lockstep.dist.{caller}(src={src}): src must be in [0, {world_size}).")


# ----------------------------------------------------------------------------- collectives


_waiter: Callable[[Any], None] | None = None
"""How this module's tensor collectives wait, when not inside torch (an elastic job's membership)."""


_interrupt: Callable[[], None] | None = None
"""What a wait that polls a collective itself calls between polls (:func:`set_collective_waiter`)."""


def set_collective_waiter(waiter: Callable[[Any], None] | None,
                          interrupt: Callable[[], None] | None = None) -> None:
    """Have :func:`barrier`, :func:`all_reduce`, :func:`broadcast` and :func:`all_gather` issue
    their collective asynchronously and hand its work object to ``waiter`` (None: wait in torch);
    ``interrupt`` raises to end such a wait (an elastic job's change of ranks), for the waits that
    poll a collective themselves (:func:`collective_interrupt`)."""
    global _waiter, _interrupt
    _waiter, _interrupt = waiter, interrupt


def collective_interrupt() -> Callable[[], None] | None:
    """What :func:`set_collective_waiter` was given to end a wait early; None when nothing ends one."""
    return _interrupt


def run_collective(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run torch's ``collective`` as this module's own collectives run: waited for through the
    waiter of :func:`set_collective_waiter` where one is set (an elastic job), else inside torch."""
    if _waiter is None:
        collective(*args, **kwargs)
    else:
        _waiter(collective(*args, **kwargs, async_op=True))


def wait_collective(work: Any) -> None:
    """Wait for the ``work`` of a collective issued with ``async_op=True`` as this module's own
    collectives wait: through the waiter of :func:`set_collective_waiter` where one is set (an
    elastic job), else inside torch."""
    if _waiter is None:
        work.wait()
    else:
        _waiter(work)


def barrier(group: torch_dist.ProcessGroup | None = None) -> None:
    """Wait until every rank (of ``group``, if given) reaches this call (no-op at world size 1)."""
    if _group_ready("barrier", group):
        run_collective(torch_dist.barrier, group=group)


def _reduce_op_name(tensor: torch.Tensor, reduce_operation: str) -> str:
    """The upper-case name of ``reduce_operation``, checked against ``tensor``'s dtype on every rank
    (world size 1 included), so a script fails the same way at any world size."""
    if not isinstance(reduce_operation, str):
        raise TypeError(
            f"all_reduce(reduce_operation={reduce_operation!r}): pass the name as a string, one of "
            f"{', '.join(_REDUCE_OPS)}."
        )
    op_name = reduce_operation.upper()
    if op_name not in _REDUCE_OPS:
        raise ValueError(
            f"all_reduce(reduce_operation={reduce_operation!r}): unknown operation; valid names are "
            f"{', '.join(_REDUCE_OPS)}."
        )
    if op_name == "AVG" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"all_reduce(reduce_operation='AVG') needs a floating-point tensor, got {tensor.dtype}. "
            "Convert it first, e.g. `tensor.float()`, or reduce with 'SUM' and divide yourself."
        )
    if op_name in _BITWISE_OPS and (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"all_reduce(reduce_operation={op_name!r}) needs an integer or bool tensor, got {tensor.dtype}. "
            "Convert it first, e.g. `tensor.int()` or `tensor.bool()`."
        )
    return op_name


def all_reduce(
    tensor: torch.Tensor, reduce_operation: str = "SUM", group: torch_dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (of ``group``, if given) in place and return it.

    ``reduce_operation`` is one of SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG (case-insensitive).
    BAND, BOR and BXOR need an integer or bool tensor. AVG needs a floating-point or complex tensor
    and divides by the size of ``group``.
    """
    op_name = _reduce_op_name(tensor, reduce_operation)
    if not _group_ready("all_reduce", group):
        return tensor
    # gloo has no AVG reduction: sum, then divide by the group's size.
    torch_op = torch_dist.ReduceOp.SUM if op_name == "AVG" else getattr(torch_dist.ReduceOp, op_name)
    run_collective(torch_dist.all_reduce, tensor, op=torch_op, group=group)
    if op_name == "AVG":
        tensor.div_(torch_dist.get_world_size(group))
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group: torch_dist.ProcessGroup | None = None) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank, in place, and return it.

    ``src`` is a global rank also when ``group`` is given (it must be a member of ``group``).
    """
    _check_src(src, "broadcast")
    if _group_ready("broadcast", group):
        run_collective(torch_dist.broadcast, tensor, src=src, group=group)
    return tensor


def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: torch_dist.ProcessGroup | None = None
) -> None:
    """Replace the items of ``object_list`` on every rank with rank ``src``'s items, in place (pickled).

    Every rank passes a list of the same length. ``src`` is a global rank, as in :func:`broadcast`.
    """
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list() needs a list, got {type(object_list).__name__}.")
    _check_src(src, "broadcast_object_list")
    if not _group_ready("broadcast_object_list", group):
        return
    if _waiter is None:
        torch_dist.broadcast_object_list(object_list, src=src, group=group)
        return
    # As all_gather_object below: torch's own would wait inside torch.
    sending = torch_dist.get_rank() == src
    data = _as_bytes(list(object_list)) if sending else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    run_collective(torch_dist.broadcast, size, src=src, group=group)
    if not sending:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    run_collective(torch_dist.broadcast, data, src=src, group=group)
    object_list[:] = pickle.loads(data.numpy().tobytes())


def all_gather(tensor: torch.Tensor, group: torch_dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Return every rank's ``tensor`` (every member's of ``group``, if given), ordered by rank.

    All ranks must pass the same shape and dtype.
    """
    if not _group_ready("all_gather", group):
        return [tensor]
    tensor = tensor.contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(torch_dist.get_world_size(group))]
    run_collective(torch_dist.all_gather, gathered, tensor, group=group)
    return gathered


def all_gather_object(obj: T, group: torch_dist.ProcessGroup | None = None) -> list[T]:
    """Return every rank's ``obj`` (every member's of ``group``, if given; pickled), ordered by rank."""
    if not _group_ready("all_gather_object", group):
        return [obj]
    if _waiter is None:
        gathered: list[Any] = [None] * torch_dist.get_world_size(group)
        torch_dist.all_gather_object(gathered, obj, group=group)
        return gathered
    # Torch's object collectives wait inside torch, where an elastic job's change of the ranks
    # could not end the wait: the same two collectives through the waiter (an elastic job's
    # process groups are gloo's, so the bytes stay on the CPU).
    padded, sizes = _padded_to_longest(obj, group)
    return _unpickled(all_gather(padded, group=group), sizes)


def gather_object(obj: T, dst: int = 0, group: torch_dist.ProcessGroup | None = None) -> list[T] | None:
    """Every rank's ``obj`` (every member's of ``group``, if given; pickled), ordered by rank, on
    rank ``dst`` (a global rank, as in :func:`broadcast`); None on the others."""
    _check_src(dst, "gather_object")
    if not _group_ready("gather_object", group):
        return [obj]
    receiving = torch_dist.get_rank() == dst
    if _waiter is None:
        gathered: list[Any] | None = [None] * torch_dist.get_world_size(group) if receiving else None
        torch_dist.gather_object(obj, gathered, dst=dst, group=group)
        return gathered
    # As all_gather_object: the sizes to every rank, then the padded bytes to dst alone.
    padded, sizes = _padded_to_longest(obj, group)
    parts = [torch.empty_like(padded) for _ in sizes] if receiving else None
    run_collective(torch_dist.gather, padded, parts, dst=dst, group=group)
    return None if parts is None else _unpickled(parts, sizes)


def scatter_object(objects: list[T] | None, src: int = 0, group: torch_dist.ProcessGroup | None = None) -> T:
    """Rank ``src``'s ``objects[i]`` on the group's i-th rank (pickled; ``src`` a global rank, as in
    :func:`broadcast`): ``src`` passes one object per rank of the group, the others pass None."""
    _check_src(src, "scatter_object")
    ready = _group_ready("scatter_object", group)
    sending = (torch_dist.get_rank() if ready else 0) == src
    count = torch_dist.get_world_size(group) if ready else 1
    if sending and (not isinstance(objects, list) or len(objects) != count):
        raise ValueError(f"scatter_object(): rank {src} passes a list of one object per rank of the group "
                         f"({count}), not {type(objects).__name__} {objects!r:.60}.")
    if not ready:
        return objects[0]  # type: ignore[index]
    if _waiter is None:
        out: list[Any] = [None]
        torch_dist.scatter_object_list(out, objects if sending else None, src=src, group=group)
        return out[0]
    # Each rank's size and the longest, then the bytes padded to the longest.
    datas = [_as_bytes(o) for o in objects] if sending and objects is not None else []
    longest = max((d.numel() for d in datas), default=0)
    size = torch.empty(2, dtype=torch.int64)
    run_collective(torch_dist.scatter, size, [torch.tensor([d.numel(), longest]) for d in datas] or None,
                   src=src, group=group)
    data = torch.empty(int(size[1]), dtype=torch.uint8)
    run_collective(torch_dist.scatter, data, [_padded(d, longest) for d in datas] or None, src=src, group=group)
    return _unpickled([data], [int(size[0])])[0]


def _as_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _padded(data: torch.Tensor, length: int) -> torch.Tensor:
    padded = torch.zeros(length, dtype=torch.uint8)
    padded[:data.numel()] = data
    return padded


def _padded_to_longest(obj: Any, group: torch_dist.ProcessGroup | None) -> tuple[torch.Tensor, list[int]]:
    """``obj`` pickled and padded to the longest of the group's pickles, and every rank's size (an
    all-gather: the padding gives every rank's part one shape)."""
    data = _as_bytes(obj)
    sizes = [int(n) for n in all_gather(torch.tensor([data.numel()], dtype=torch.int64), group=group)]
    return _padded(data, max(sizes)), sizes


def _unpickled(parts: list[torch.Tensor], sizes: list[int]) -> list[Any]:
    return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(parts, sizes)]


# ----------------------------------------------------------------------------- signal files


def get_node_signal_file_name(rng: random.Random | None = None) -> str:
    """Return a fresh file name for a file-based wait within a node, such as
    :func:`busy_wait_for_local_rank_zero`'s. Every rank must call it (a broadcast from rank 0).

    The random part is drawn from ``rng`` (default: a new ``random.Random()``) on rank 0, so all
    ranks of a node get the same name. Unlike Composer's, the name carries this rank's own node rank,
    so nodes that share a directory do not use, and remove, the same file.
    """
    if rng is None:
        rng = random.Random()
    token = ["".join(rng.choices(string.ascii_letters + string.digits, k=6))]
    broadcast_object_list(token, src=0)
    return f"._signal_file_node{get_node_rank()}_{token[0]}"


def write_signal_file(signal_file_name: str, dir_path: str | os.PathLike[str] | None = None) -> str:
    """Create ``signal_file_name`` in ``dir_path`` on local rank 0 and return its path on every rank.

    ``dir_path`` (default: the current directory) is created if missing. Other local ranks write
    nothing; they are expected to wait for the file, e.g. with :func:`local_rank_zero_download_and_wait`.
    """
    if dir_path:
        os.makedirs(dir_path, exist_ok=True)
    path = os.path.join(dir_path or os.getcwd(), signal_file_name)
    if get_local_rank() == 0:
        with open(path, "w") as file:
            file.write("local rank 0 done\n")
    return path


@contextlib.contextmanager
def busy_wait_for_local_rank_zero(dir_path: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Run the ``with`` body on every rank, then hold each rank until its node's local rank 0 has
    finished the body and every rank has arrived.

    Local rank 0 signals the end of its body with a file in ``dir_path`` (default: the current
    directory), which the other local ranks poll for every 0.1 s without a time limit; a barrier
    follows, then local rank 0 removes the file. Every rank must enter it (the file name is agreed by
    a broadcast), so at world size > 1 it needs a process group. If the body raises on local rank 0,
    the others wait until the launcher ends them.
    """
    signal_file_name = get_node_signal_file_name()
    yield
    path = write_signal_file(signal_file_name, dir_path)
    # Polling a file rather than waiting in a collective: local rank 0's body may outlast the
    # process group's timeout (a long download, say).
    if get_world_size() > 1 and get_local_rank() != 0:
        _wait_for_file(path, math.inf, 0.1, warn_after=math.inf)
    # Every local rank must have seen the file before local rank 0 removes it.
    barrier()
    if get_local_rank() == 0:
        os.remove(path)


# ----------------------------------------------------------------------------- data and files


def get_sampler(
    dataset: Dataset[Any],
    *,
    drop_last: bool = False,
    shuffle: bool = False,
    num_replicas: int | None = None,
    rank: int | None = None,
    seed: int = 0,
) -> DistributedSampler[Any]:
    """Return a DistributedSampler that gives rank ``rank`` of ``num_replicas`` its share of ``dataset``.

    ``num_replicas`` and ``rank`` default to the world size and this process's global rank. As in
    Composer, ``shuffle`` defaults to False: pass ``shuffle=True`` for a training set. Works without
    a process group. Call ``sampler.set_epoch(epoch)`` each epoch to reshuffle.
    """
    return DistributedSampler(
        dataset,
        num_replicas=get_world_size() if num_replicas is None else num_replicas,
        rank=get_global_rank() if rank is None else rank,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=seed,
    )


@contextlib.contextmanager
def run_local_rank_zero_first() -> Iterator[None]:
    """Run the ``with`` body on local rank 0 first; the other ranks run it after every node's local
    rank 0 has finished (e.g. local rank 0 downloads a data set, the others then read the cache).

    No-op at world size 1. If the body raises on local rank 0 the others are not released; they fail
    when that rank's process exits.
    """
    if not _group_ready("run_local_rank_zero_first"):
        yield
        return
    is_local_zero = get_local_rank() == 0
    if not is_local_zero:
        barrier()
    yield
    if is_local_zero:
        barrier()


def local_rank_zero_download_and_wait(
    expected_file_path: str | os.PathLike[str], *, timeout: float = math.inf, poll_interval: float = 0.1
) -> contextlib.AbstractContextManager[None]:
    """On local ranks other than 0, wait until ``expected_file_path`` exists (local rank 0 is
    expected to create it).

    Local rank 0 returns at once. No-op at world size 1. Needs no process group. As in Composer, the
    wait has no time limit by default (a download may take hours); pass ``timeout`` (seconds) to raise
    TimeoutError instead. A rank still waiting after 300 s warns once, naming the path. Composer's
    version is a context manager that waits on entry; this one waits in the call and returns an empty
    context manager, so both ``local_rank_zero_download_and_wait(path)`` and
    ``with local_rank_zero_download_and_wait(path):`` work.
    """
    if get_world_size() > 1 and get_local_rank() != 0:
        _wait_for_file(expected_file_path, timeout, poll_interval, warn_after=_SLOW_WAIT_WARNING)
    return contextlib.nullcontext()


def _wait_for_file(
    path: str | os.PathLike[str], timeout: float, poll_interval: float, warn_after: float
) -> None:
    start = time.monotonic()
    warned = False
    while not os.path.exists(path):
        waited = time.monotonic() - start
        if waited >= timeout:
            raise TimeoutError(
                f"Local rank {get_local_rank()} waited {timeout:g} s for {os.fspath(path)!r}, which local "
                "rank 0 should create, and it does not exist. Check that local rank 0 writes this exact "
                "path, or raise the timeout."
            )
        if not warned and waited >= warn_after:
            warned = True
            warnings.warn(
                f"Local rank {get_local_rank()} has waited {waited:.0f} s for {os.fspath(path)!r}, which "
                "local rank 0 should create, and goes on waiting. Check that local rank 0 writes this "
                "exact path; to give up after a while, pass timeout=SECONDS.",
                stacklevel=3,
            )
        time.sleep(poll_interval)
