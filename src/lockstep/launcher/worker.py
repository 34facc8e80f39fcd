"""Worker bootstrap: ``python -m lockstep.launcher.worker {script|module} TARGET [ARGS...]``.

Runs the user's script or module the way ``python TARGET`` / ``python -m TARGET`` would, plus
things that happen when (and only if) the script imports torch:

* on the rank that hosts the rendezvous store, the c10d TCPStore server starts on the listening
  socket the launcher bound and passed down (``LOCKSTEP_STORE_FD``), so the port is never released
  and nothing can take it between choosing and binding;
* an exit hook destroys the default process group, because a gloo process that exits right after a
  collective without ``destroy_process_group`` can abort with SIGABRT while the interpreter shuts
  down (torch 2.13);
* in a rank of an elastic job that started without some nodes, or joins a running one, the
  script's own ``torch.distributed.init_process_group()`` forms the group of the ranks there are
  (:func:`lockstep.regroup.route_init_process_group`), not the launch's, which would wait for them.

Before the script starts, ``faulthandler`` is registered on SIGQUIT: the launcher sends it to show
where every thread of every rank is (``kill -QUIT`` on the launcher, or a stall). It writes from
the signal handler itself, so it works while the rank is blocked in C code or holds the GIL, and it
writes to a file in the launcher's control folder, not to the rank's own output.

SIGUSR1 and SIGUSR2, which the launcher passes on to every rank (a batch scheduler's warning before
preemption), get a handler that does nothing, so a script that installs none of its own goes on
instead of being killed by the signal's default action.

Interpreter shutdown with torch loaded spends ~0.5 s in repeated garbage collections over a heap
of torch objects. After the script ends, the bootstrap collects garbage once (so cyclic garbage is
finalized as usual), flushes every open file object, then freezes the heap so those final passes
skip it: shutdown takes about half as long. ``LOCKSTEP_FAST_EXIT=0`` turns this off.

This module imports only the standard library: a script that never imports torch pays nothing.
"""

from __future__ import annotations

import atexit
import builtins
import _thread
import datetime
import faulthandler
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import runpy
import signal
import sys
from types import CodeType, ModuleType
from typing import Any

_STORE_FD_ENV = "LOCKSTEP_STORE_FD"
_ELASTIC_START_ENV, _ELASTIC_JOIN_ENV = "LOCKSTEP_ELASTIC_START", "LOCKSTEP_ELASTIC_JOIN"  # elastic_names' (no lockstep import here)
_store: Any = None  # the TCPStore server; must live as long as the process
_stacks_file: Any = None  # faulthandler keeps only the descriptor: the file object must live on


def _on_torch_imported() -> None:
    global _store
    atexit.register(_destroy_process_group)
    if os.environ.get(_ELASTIC_START_ENV) or os.environ.get(_ELASTIC_JOIN_ENV):
        from lockstep import regroup  # torch is loaded by now

        regroup.route_init_process_group()
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


def _register_stack_dump() -> None:
    global _stacks_file
    folder, rank = os.environ.get("LOCKSTEP_CONTROL_DIR"), os.environ.get("RANK")
    if not folder or rank is None:
        return
    try:
        _stacks_file = open(os.path.join(folder, f"rank{rank}.stacks"), "a", encoding="utf-8")
        faulthandler.register(signal.SIGQUIT, file=_stacks_file, all_threads=True, chain=False)
        # The launcher signals only a rank whose file has this line: the handler is in place.
        _stacks_file.write(f"main thread 0x{_thread.get_ident():016x}\n")
        _stacks_file.flush()
    except (OSError, ValueError, RuntimeError):
        _stacks_file = None


def _ignore_user_signals() -> None:
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(signum) is signal.SIG_DFL:
            # A Python handler, not SIG_IGN: programs the script runs get the default action back.
            signal.signal(signum, _no_op)


def _no_op(signum: int, frame: Any) -> None:
    pass


def _destroy_process_group() -> None:
    # No barrier here: this also runs when the process exits because of an exception, and peers
    # may be gone. destroy_process_group itself does not wait for them.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _prepare_fast_shutdown() -> None:
    if "torch" not in sys.modules or os.environ.get("LOCKSTEP_FAST_EXIT") == "0":
        return
    gc.collect()
    for obj in gc.get_objects():
        # type(), not isinstance(): the ABC check reads obj.__class__, which some torch objects
        # answer with a deprecation warning.
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass
    gc.freeze()


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


def _exec_as_main(code: CodeType, **attrs: Any) -> None:
    """Run code in a fresh, real ``__main__`` module, as the interpreter does for a script.

    runpy.run_path would use a temporary module whose globals are not torn down at exit the way
    ``__main__``'s are, so objects a script leaves in its globals would not be finalized.
    """
    main = ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, **attrs)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _run_script(path: str) -> None:
    if not os.path.isfile(path) or _is_zip(path):  # a folder or zip with __main__.py
        runpy.run_path(path, run_name="__main__")
        return
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    _exec_as_main(code, __file__=path, __cached__=None, __spec__=None, __loader__=loader)


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def _run_module(name: str) -> None:
    # `python -m` puts the working directory first on sys.path; so does `-m` here.
    sys.path[0] = os.getcwd()
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"lockstep: no module named {name!r}")
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        spec = importlib.util.find_spec(f"{name}.__main__")
        if spec is None:
            raise SystemExit(f"lockstep: {name!r} is a package without a __main__ module")
    code = spec.loader.get_code(spec.name)
    _exec_as_main(code, __file__=spec.origin, __cached__=spec.cached, __spec__=spec,
                  __loader__=spec.loader, __package__=spec.parent)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("script", "module"):
        raise SystemExit("usage: python -m lockstep.launcher.worker {script|module} TARGET [ARGS...]")
    mode, target, args = argv[0], argv[1], argv[2:]
    _register_stack_dump()
    _ignore_user_signals()
    if "torch" in sys.modules:
        _on_torch_imported()
    else:
        sys.meta_path.insert(0, _TorchImportHook())
    sys.argv = [target, *args]
    try:
        (_run_module if mode == "module" else _run_script)(target)
    except SystemExit as e:
        if e.code not in (None, 0):
            _record_failed_end()
        raise
    except Exception as e:
        _record_failed_end()
        if not getattr(e, _CONFIGURATION, False) or os.environ.get("LOCKSTEP_VERBOSE", "") not in ("", "0"):
            raise
        _record_configuration_error(e)
        raise SystemExit(1) from None
    finally:
        _prepare_fast_shutdown()


_CONFIGURATION = "lockstep_configuration"  # lockstep.errors.MARK (this module imports no lockstep)


def _record_failed_end() -> None:
    """When the script ended with an error, for the launcher (lockstep.progress.ended_path): a
    peer whose collective this rank's teardown breaks may exit first, and must not be named."""
    import time

    folder, rank = os.environ.get("LOCKSTEP_CONTROL_DIR"), os.environ.get("RANK")
    if folder and rank is not None:
        try:
            with open(os.path.join(folder, f"rank{rank}.ended"), "w", encoding="utf-8") as f:
                f.write(repr(time.time()))
        except OSError:
            pass


def _record_configuration_error(error: Exception) -> None:
    """A configuration error (lockstep.errors): into the error file, with its traceback, for the
    launcher to print once for the job; nothing on this rank's console. Without an error file
    (not under the launcher), the one line goes to stderr."""
    import json
    import time
    import traceback

    lines = str(error).strip().splitlines()
    message = lines[0] if lines else type(error).__name__
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        print(f"lockstep: error: {message}", file=sys.stderr, flush=True)
        return
    record = {"message": {"message": f"{type(error).__name__}: {message}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(error)), "timestamp": str(int(time.time())),
        _CONFIGURATION: True}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:
        print(f"lockstep: error: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
