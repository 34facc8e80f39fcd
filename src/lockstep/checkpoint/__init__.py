"""Checkpoints: atomic, verified files that resume a run exactly, and export to plain weights.

The Trainer saves and loads through ``save_folder``/``load_path``/``autoresume``. This package's
public functions work on their own too::

    from lockstep.checkpoint import export_state_dict, export_safetensors
    weights = export_state_dict("checkpoints/latest-rank0.pt")
    export_safetensors("checkpoints/ep2-ba100-rank0.pt", "model.safetensors")

or from the shell: ``python -m lockstep.checkpoint export CHECKPOINT OUT.safetensors``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointError", "DamagedCheckpoint", "export_safetensors", "export_state_dict"]


def __getattr__(name: str) -> Any:
    # lazy: a submodule (files, say) can be imported without the rest and its dependencies
    if name in ("CheckpointError", "DamagedCheckpoint"):
        from lockstep.checkpoint import files
        return getattr(files, name)
    if name in ("export_state_dict", "export_safetensors"):
        from lockstep.checkpoint import export
        return getattr(export, name)
    raise AttributeError(f"module 'lockstep.checkpoint' has no attribute {name!r}")
