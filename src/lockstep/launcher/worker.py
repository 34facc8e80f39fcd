"""Worker bootstrap: ``python -m lockstep.launcher.worker {script|module} TARGET [ARGS...]``.

Runs the user's script or module the way ``python TARGET`` / ``python -m TARGET`` would, plus two
things that happen when (and only if) the script imports torch:

* on the rank that hosts the rendezvous store, the c10d TCPStore server starts on the listening
  socket the launcher bound and passed down (``LOCKSTEP_STORE_FD``), so the port is never released
  and nothing can take it between choosing and binding;
* an exit hook destroys the default process group, because a gloo process that exits right after a
  collective without ``destroy_process_group`` can abort with SIGABRT while the interpreter shuts
  down (torch 2.13).

This module imports only the standard library: a script that never imports torch pays nothing.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from types import ModuleType
from typing import Any

_STORE_FD_ENV = "LOCKSTEP_STORE_FD"
_store: Any = None  # the TCPStore server; must live as long as the process


def _on_torch_imported() -> None:
    global _store
    atexit.register(_destroy_process_group)
    fd = os.environ.pop(_STORE_FD_ENV, None)
    if fd is None:
        return
    from torch.distributed import TCPStore

    _store = TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=True,
        timeout=datetime.timedelta(seconds=1800),
        wait_for_workers=False,
        master_listen_fd=int(fd),
    )


def _destroy_process_group() -> None:
    # No barrier here: this also runs when the process exits because of an exception, and peers
    # may be gone. destroy_process_group itself does not wait for them.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Calls back once the top-level ``torch`` package has finished importing."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module: ModuleType) -> None:
            exec_module(module)
            _on_torch_imported()

        spec.loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("script", "module"):
        raise SystemExit("usage: python -m lockstep.launcher.worker {script|module} TARGET [ARGS...]")
    mode, target, args = argv[0], argv[1], argv[2:]
    if "torch" in sys.modules:
        _on_torch_imported()
    else:
        sys.meta_path.insert(0, _TorchImportHook())
    if mode == "module":
        # `python -m` puts the working directory first on sys.path; so does `-m` here.
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
