"""What a checkpoint layout is: its names, and the interface the saver, the loader and the Trainer call.

A layout is how one parallel backend's model and optimizer state go into a checkpoint and back;
the backend makes it (``Strategy.layout()``). Every layout is a :class:`Layout`. Those
that write a folder every rank writes into (FSDP ``sharded``, DeepSpeed) are also a
:class:`FolderLayout`; their ``name`` is in :data:`FOLDER_LAYOUTS`, which is what :func:`is_folder`
reads. The implementations are in :mod:`lockstep.checkpoint.states` (DDP),
:mod:`lockstep.checkpoint.fsdp_states` (FSDP) and :mod:`lockstep.checkpoint.deepspeed`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

SINGLE, LOCAL, SHARDED, DEEPSPEED = "single", "local", "sharded", "deepspeed"
FOLDER_LAYOUTS = (SHARDED, DEEPSPEED)
"""Layouts whose checkpoint is a folder that every rank writes into."""
SHARDED_META = "lockstep.pt"
"""In a checkpoint folder: everything but the model and optimizer tensors."""
INDEX, NAME = "index", "name"
"""How optimizer state is keyed: by parameter index (``Optimizer.state_dict``) or by parameter name."""


class Layout(Protocol):
    """What every layout does: gather the state to save, and load a file's tensors back.

    A single-file layout (``single``, ``local``) is only this: its writers put what :meth:`gather`
    returns in one file each. A folder layout adds :class:`FolderLayout`'s methods.
    """

    name: str
    """SINGLE, LOCAL, SHARDED or DEEPSPEED: recorded in each checkpoint and checked when loading."""
    optimizer_keys: str
    """How the optimizer state it saves is keyed: INDEX, NAME, or DEEPSPEED (the engine's own)."""
    collective: bool
    """Whether :meth:`gather` is a collective (then every rank calls it, not only writers)."""
    stage: int | None
    """DeepSpeed's ZeRO stage, which a checkpoint resumes only at; None in other layouts."""
    model: nn.Module
    optimizers: list[torch.optim.Optimizer]

    def extra_meta(self) -> dict[str, Any]:
        """More header fields for this rank's file."""
        ...

    def restore_meta(self, meta: dict[str, Any]) -> None:
        """Put back what :meth:`extra_meta` recorded (``meta`` is the header), after the model and
        optimizers are loaded, when a run resumes (not with weights only); every rank."""
        ...

    def gather(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Model and optimizer state to save; when :attr:`collective`, every rank calls it and
        ranks that do not write may get empty dicts."""
        ...

    def step_storages(self) -> set[tuple[str, int]]:
        """Keys (``staging.storage_key``) of the storages that only an optimizer step changes in
        place, which a background save may copy until the next step."""
        ...

    def rank_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers this rank may hold differently from rank 0, for its own entry in the checkpoint."""
        ...

    def load_rank_buffers(self, saved: dict[str, torch.Tensor]) -> None:
        """Put back what :meth:`rank_buffers` saved."""
        ...

    def full_reader(self) -> Layout:
        """The layout that loads a single-file checkpoint's full tensors into this run."""
        ...

    def load_model(self, weights: dict[str, Any], path: Path, strict: bool) -> None:
        """Load the model's tensors as this layout saved them (``path`` names the checkpoint in errors)."""
        ...

    def load_optimizers(self, saved: list[Any], path: Path) -> None:
        """Load each optimizer's state as this layout saved it (keyed by :attr:`optimizer_keys`)."""
        ...


class FolderLayout(Layout, Protocol):
    """A layout whose checkpoint is a folder that every rank writes its part into, with rank 0's
    ``lockstep.pt`` (:data:`SHARDED_META`) beside the parts."""

    def folder_parts(self, temp: Path, model: dict[str, Any], optimizers: list[Any]) -> tuple[Any, list[Any]]:
        """Every rank: (this rank's part, which :meth:`write_parts` writes into ``temp``, the
        optimizers' parts that go in lockstep.pt instead), from what :meth:`gather` returned."""
        ...

    def write_parts(self, temp: Path, parts: Any, group: ProcessGroup | None) -> dict[str, list[int]]:
        """Every rank (a collective over ``group``): write ``parts``; every rank's are durable in
        ``temp`` on return (on the disks of the ranks that wrote them). Returns every rank's records
        of its files (``{name: [size, CRC32]}``, :func:`lockstep.checkpoint.integrity.record`)."""
        ...

    def seal(self, temp: Path, meta: dict[str, Any]) -> None:
        """Rank 0, once every rank's parts are written, before it writes ``meta`` as lockstep.pt."""
        ...

    def load_folder(self, folder: Path, content: dict[str, Any], *, weights_only: bool, strict: bool) -> None:
        """Load the model (and, unless ``weights_only``, optimizer) state of a checkpoint folder;
        ``content`` is its lockstep.pt."""
        ...


def is_folder(layout: Layout) -> TypeGuard[FolderLayout]:
    """Whether ``layout`` writes a folder every rank writes into (its ``name`` says so)."""
    return layout.name in FOLDER_LAYOUTS
