"""Ranks forked from an interpreter that has imported torch once: ``python -m lockstep.launcher.prefork``.

A fresh interpreter spends about two seconds of CPU importing torch and lockstep before a script's
first line runs; eight ranks on a node spend sixteen, all at once, and a restart or a re-formed
elastic job pays it again. The launcher instead starts one *prefork server* (a teardown spares
it, since it runs nothing of the job's: every attempt's ranks fork from it), which imports torch
(:data:`DEFAULT_PRELOAD`) and what the script, and the modules of its folder that it imports,
import of torch, lockstep and torchmetrics (read from their source, never run), or the
modules ``LOCKSTEP_PREFORK`` names, and then forks each rank from that state (a script that, with
the modules of its folder, imports only the standard library has nothing to share: its ranks start
as fresh interpreters, in milliseconds, with no server). A rank then runs the
same worker bootstrap (:mod:`worker`) as a fresh one, with its own environment, working directory,
standard streams, passed descriptors and signal dispositions, and numpy's global generator seeded
anew (a fork would copy it).

Each rank is forked through a short-lived middle process that exits at once, so the rank is
re-parented to the launcher (a child subreaper): the launcher waits for it, reads its exit status
and signals its process group exactly as for a rank it started itself. The rank registers its
process group with the watchdog before anything else, as a Popen'd rank does between fork and exec.

What differs from a fresh interpreter: the preloaded modules were imported with the environment
the server started with (what every rank's shares: no ``RANK``), so a script that sets, say, ``OMP_NUM_THREADS`` in
``os.environ`` *before* ``import torch`` gets torch as already imported. ``LOCKSTEP_PREFORK=0``
starts every rank as a fresh interpreter.

The server part of this module imports only the standard library until it preloads.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import ast
import importlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["DEFAULT_PRELOAD", "PREFORK_ENV", "ForkedRank", "PreforkServer", "preload_list"]

PREFORK_ENV = "LOCKSTEP_PREFORK"
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
"""torch._dynamo too: every optimizer's constructor imports it (~1 s of CPU a rank otherwise). It
is left out for a script that plainly builds no optimizer and compiles nothing (:func:`preload_list`)."""
_DYNAMO = "torch._dynamo"
_DYNAMO_WORDS = (b"optim", b"compile", b"dynamo", b"Trainer", b"DataParallel", b"DDP", b"fsdp", b"FSDP",
                 b"fully_shard", b"deepspeed", b"checkpoint", b"export", b"jit")
"""Words whose absence from every file read, with nothing imported but the standard library, the
script's own modules, torch and ``lockstep.dist``, shows that no rank imports torch._dynamo."""
_SAFE_ROOTS = ("torch", "lockstep", "torchmetrics")
"""Packages whose modules a server imports for a script: ones that read nothing at import that
differs between ranks (torchmetrics, which also imports transformers and scipy, costs each rank
~3 s of CPU otherwise). A user's own modules are left to each rank, which imports them itself."""
_WORKER = ("-u", "-m", "lockstep.launcher.worker")
_MAX_MESSAGE = 1 << 20
FROZEN = False
"""Whether this process is a server, or a rank forked from one, whose preloaded objects are frozen
(:func:`gc.freeze`): asking :func:`gc.get_freeze_count` walks them all (~0.04 s)."""
_PR_SET_PDEATHSIG = 1
_READY_TIMEOUT_S = 300.0
# Signals the launcher forwards to the whole job or uses itself: the server only stands by.
_BYSTANDER = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_RESET = (*_BYSTANDER, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCHLD, signal.SIGALRM)


def preload_list(environ: Mapping[str, str], script: str | None = None) -> tuple[str, ...]:
    """What a server imports: the modules ``LOCKSTEP_PREFORK`` names (comma-separated; ``0`` or
    empty: none, and ranks start as fresh interpreters); unset or ``1``: torch and what ``script``
    imports of torch, lockstep and torchmetrics (:func:`script_imports`; ``module`` or
    ``module:name`` for ``from module import name``), or none for a script of the standard
    library and its own modules alone; ``+`` before the names: those as well as what is read
    from the script (``+deepspeed``: DeepSpeed, which a Trainer imports only at run time)."""
    value = environ.get(PREFORK_ENV, "1").strip()
    named = tuple(name.strip() for name in value.lstrip("+").split(",") if name.strip() not in ("", "0", "1"))
    if value != "1" and not value.startswith("+"):  # "0" or "": none
        return named
    found, stdlib_only, plain = _read_imports(script)
    if stdlib_only and not named:  # no torch to share: fresh interpreters start in milliseconds
        return ()
    default = tuple(m for m in DEFAULT_PRELOAD if m != _DYNAMO or not plain)
    return tuple(dict.fromkeys((*default, *found, *named)))


def script_imports(script: str | None) -> tuple[str, ...]:
    """The modules (and names) of :data:`_SAFE_ROOTS` that a python file imports anywhere, read
    from its source, and those that the modules of its own folder it imports do (``from mymodels
    import Net`` whose ``mymodels.py`` imports torchmetrics), each file read once. Only files are
    read: none of them runs here."""
    return _read_imports(script)[0]


def _read_imports(script: str | None) -> tuple[tuple[str, ...], bool, bool]:
    """:func:`script_imports`; whether every file read imports only the standard library and the
    script's own modules (so that no rank can import torch, short of importing it by name at run
    time); and whether they import nothing else but torch and ``lockstep.dist`` either, and none
    names :data:`_DYNAMO_WORDS` (no rank imports torch._dynamo). Both False for a file that cannot
    be read or parsed, or where more than :data:`_MAX_FILES` would have to be."""
    if script is None or not script.endswith(".py"):
        return (), False, False
    folder = os.path.dirname(os.path.abspath(script))
    found: dict[str, None] = {}
    todo, read, stdlib_only, plain = [os.path.abspath(script)], set(), True, True
    while todo:
        path = todo.pop()
        if path in read:
            continue
        if len(read) >= _MAX_FILES:
            return tuple(found), False, False
        read.add(path)
        imports, words = _imports(path)
        stdlib_only = stdlib_only and imports is not None
        plain = plain and imports is not None and not words
        for name, own in imports or ():
            root = name.split(":")[0].split(".")[0]
            if root in _SAFE_ROOTS:
                found[name] = None
            own_files = _own_files(folder, name) if own else []
            todo.extend(own_files)
            if not own_files and root not in sys.stdlib_module_names and not _is_own(folder, root):
                stdlib_only = False  # a relative import's root is "": never the standard library's
                plain = plain and _plain(name)
    return tuple(found), stdlib_only, plain


def _plain(name: str) -> bool:
    """Whether importing ``name`` (as :func:`_imports` gives it) leaves torch._dynamo unimported:
    torch's modules do, and of lockstep only ``lockstep.dist``."""
    module, _, attr = name.partition(":")
    return module.split(".")[0] == "torch" or module == "lockstep.dist" or (module == "lockstep" and attr in ("", "dist"))


_MAX_FILES = 50
"""The most files :func:`script_imports` reads for one script."""


def _imports(path: str) -> tuple[list[tuple[str, bool]] | None, bool]:
    """(module, or ``module:name`` for ``from module import name``; whether it may be one of the
    script's own modules) for each absolute import in the file, in order, and ``("", False)`` for
    each relative one, None for a file that cannot be read or parsed; and whether the file names
    one of :data:`_DYNAMO_WORDS`."""
    try:
        with open(path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, path)
    except (OSError, SyntaxError, ValueError):
        return None, True
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, True) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append(("", False))  # relative to a package: not followed
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, True))
            out.extend((f"{node.module}:{a.name}", False) for a in node.names if a.name != "*")
            out.extend((f"{node.module}.{a.name}", True) for a in node.names
                       if a.name != "*" and node.module.split(".")[0] not in _SAFE_ROOTS)
    return out, any(word in source for word in _DYNAMO_WORDS)


def _own_files(folder: str, module: str) -> list[str]:
    """The files of ``module`` in the script's ``folder`` (a module file, or a package's
    ``__init__.py``), where it is one of the script's own."""
    base = os.path.join(folder, *module.split("."))
    return [path for path in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(path)]


def _is_own(folder: str, root: str) -> bool:
    """Whether the top-level module ``root`` is one of the script's own (a module or package of its folder)."""
    base = os.path.join(folder, root)
    return bool(root) and (os.path.isfile(base + ".py") or os.path.isdir(base))


_DEEPSPEED = "lockstep.parallel.deepspeed_preload"
"""What a server imports for DeepSpeed: DeepSpeed as lockstep imports it, and only on a CPU build
of torch (importing it initialises CUDA, after which no rank forked from the server could use it)."""


def _preload(name: str) -> None:
    if name.partition(":")[0].split(".")[0] == "deepspeed":
        name = _DEEPSPEED
    module, _, attr = name.partition(":")
    loaded = importlib.import_module(module)
    if attr and not hasattr(loaded, attr):  # a lazy attribute is loaded by the lookup itself
        importlib.import_module(f"{module}.{attr}")


# -- launcher side ----------------------------------------------------------------------------

class ForkedRank:
    """A rank forked by the server and re-parented to this process: what the launcher uses of
    :class:`subprocess.Popen` (``pid``, ``stdout``, ``stderr``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None:
            raise NotImplementedError("ForkedRank.wait takes no timeout: use poll")
        while self.returncode is None:
            self._reap(0)
        return self.returncode

    def _reap(self, options: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, options)
        except ChildProcessError:  # collected elsewhere: its status is gone (as Popen does)
            self.returncode = 0
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)


class PreforkServer:
    """The launcher's handle on one prefork server (one per launcher: a teardown spares it, and
    every attempt's ranks fork from it)."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], watchdog_fd: int,
                 preload: Sequence[str]) -> None:
        """``command``: the ranks' (the worker bootstrap's argv), whose target and arguments the
        server's command line shows too, so that ``ps`` and ``pkill -f`` find the ranks by them;
        ``preload``: what the server imports (:func:`preload_list`)."""
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._proc = subprocess.Popen(
                [command[0], "-u", "-m", "lockstep.launcher.prefork", str(theirs.fileno()), str(watchdog_fd),
                 ",".join(preload), *command[len(_WORKER) + 1:]],
                env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(), watchdog_fd), process_group=0,
            )
        self._sock.settimeout(_READY_TIMEOUT_S)
        try:
            ready = self._sock.recv(16) == b"ready"
        except OSError:
            ready = False
        self.usable = ready
        if not ready:
            self.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self.usable and self._proc.poll() is None

    def spawn(self, command: Sequence[str], env: Mapping[str, str], stdout: IO[bytes] | int | None,
              stderr: IO[bytes] | int | None, pass_fds: tuple[int, ...]) -> ForkedRank | None:
        """Fork a rank running ``command`` (the worker bootstrap's argv); None where the server
        cannot (it died): the caller then starts the rank itself."""
        if not self.usable:
            return None
        ours: list[int] = []
        theirs: list[int] = []
        streams: list[IO[bytes] | None] = []
        try:
            for target, inherited in ((stdout, 1), (stderr, 2)):
                if target is None:
                    theirs.append(inherited)
                    streams.append(None)
                elif target == subprocess.PIPE:
                    read_end, write_end = os.pipe()
                    ours.append(write_end)
                    theirs.append(write_end)
                    streams.append(open(read_end, "rb"))  # noqa: SIM115 - the pump owns it
                else:
                    theirs.append(target.fileno())  # type: ignore[union-attr]
                    streams.append(None)
            devnull = os.open(os.devnull, os.O_RDONLY)
            ours.append(devnull)
            request = {"argv": list(command[len(_WORKER) + 1:]), "env": dict(env), "cwd": os.getcwd(),
                       "targets": [1, 2, 0, *pass_fds], "ignored": _ignored_signals()}
            self._sock.settimeout(60.0)
            socket.send_fds(self._sock, [pickle.dumps(request)], [*theirs, devnull, *pass_fds])
            reply = self._sock.recv(64)
            if len(reply) != 8:
                raise OSError("the prefork server ended")
            (pid,) = struct.unpack("q", reply)
        except OSError:
            for stream in streams:
                if stream is not None:
                    stream.close()
            self.usable = False
            self.close()
            return None
        finally:
            for fd in ours:
                os.close(fd)
        return ForkedRank(pid, streams[0], streams[1])

    def close(self) -> None:
        """End the server (it exits once its socket closes) and wait for it."""
        self.usable = False
        self._sock.close()
        with contextlib.suppress(ChildProcessError):
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def command_forkable(command: Sequence[str], python: str) -> bool:
    """Whether ``command`` is the worker bootstrap run by ``python``, which a server can fork."""
    return len(command) > 4 and command[0] == python and tuple(command[1:4]) == _WORKER


def _ignored_signals() -> list[int]:
    """The signals this process ignores: a rank started with exec would inherit them ignored."""
    return [int(s) for s in _RESET if signal.getsignal(s) == signal.SIG_IGN]


# -- server side ------------------------------------------------------------------------------

def _serve(sock_fd: int, watchdog_fd: int, preload: list[str]) -> list[str] | None:
    """Preload, then fork a rank per request. Returns in each rank (its argv), None in the server
    once the launcher has gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher's death ends the server
    for signum in _BYSTANDER:
        signal.signal(signum, signal.SIG_IGN)
    sock = socket.socket(fileno=sock_fd)
    # Importing torch makes objects by the hundred thousand, nearly none of them garbage: the
    # collector's passes over them during the imports cost ~20% of their CPU, for nothing.
    gc.disable()
    try:
        for name in preload:
            with contextlib.suppress(Exception):
                _preload(name)
    finally:
        gc.enable()
    if "torch" in preload and "torch" not in sys.modules:
        return None  # torch did not import: ranks start fresh and report why themselves
    if len(os.listdir("/proc/self/task")) > 1:
        return None  # an import started a thread: a fork would copy whatever lock it holds
    # What is loaded now lives as long as every rank: the collector never need look at it again
    # (nor, by writing to its objects, copy their pages into each rank). No collection first: it
    # cost ~0.3 s of CPU a launch to free ~9,000 small objects of the imports' own cycles (tuples,
    # cells, functions; nothing with a finalizer), which stay, shared by the ranks, instead.
    importlib.import_module("lockstep.launcher.prefork").FROZEN = True  # this runs as __main__
    gc.freeze()
    sock.sendall(b"ready")
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 64)
        except OSError:
            return None
        if not data:
            return None
        request = pickle.loads(data)
        try:
            pid = _fork_rank(sock, watchdog_fd, request, fds)
        except OSError:
            pid = -1
        if pid is None:  # this is the rank
            return request["argv"]
        for fd in fds:
            os.close(fd)
        sock.sendall(struct.pack("q", pid) if pid > 0 else b"failed")


def _fork_rank(sock: socket.socket, watchdog_fd: int, request: dict[str, Any], fds: list[int]) -> int | None:
    """The new rank's pid in the server; None in the rank. A middle process forks the rank and
    exits, so the rank's parent becomes the launcher."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        # Read here, not in the rank: the middle may have exited before the rank asks for its
        # parent, which is then the launcher, and the rank would wait for an adoption already done.
        middle_pid = os.getpid()
        try:
            rank = os.fork()
        except OSError:
            os._exit(1)
        if rank == 0:
            os.close(write_end)
            try:
                _become_rank(sock, watchdog_fd, request, fds, middle_pid)
            except BaseException as e:  # noqa: BLE001 - the rank must not go back into the server's loop
                os.write(2, f"lockstep: a rank could not start: {e}\n".encode())
                os._exit(1)
            return None
        os.write(write_end, struct.pack("q", rank))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        raw = pipe.read(8)
    os.waitpid(middle, 0)
    if len(raw) != 8:
        raise OSError("could not fork a rank")
    return struct.unpack("q", raw)[0]


def _become_rank(sock: socket.socket, watchdog_fd: int, request: dict[str, Any], fds: list[int],
                 middle: int) -> None:
    os.setpgid(0, 0)  # a process group of its own, as Popen(process_group=0)
    os.write(watchdog_fd, b"+%d\n" % os.getpid())  # guarded before it runs anything
    os.close(watchdog_fd)
    sock.close()
    # Above every target first: a received descriptor may have a target's number.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, max(request["targets"]) + 1) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, request["targets"]):
        os.dup2(fd, target)  # inheritable, as Popen leaves the standard streams and pass_fds
    for fd in moved:
        os.close(fd)
    for signum in _RESET:
        ignored = int(signum) in request["ignored"]
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, signal.SIG_IGN if ignored else default)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fork copies the generator: every rank would draw the same numbers
    _await_adoption(middle)


def _await_adoption(middle: int, timeout: float = 10.0) -> None:
    """Return once the middle process has exited and the launcher adopted this rank, so that the
    script sees the launcher as its parent from its first line (``os.getppid()``, a parent-death
    signal). The middle exits at once, but tearing down a large address space takes a moment."""
    deadline = time.monotonic() + timeout
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.001)


def main(argv: list[str]) -> None:
    # what follows the three is only for ps to show
    served = _serve(int(argv[0]), int(argv[1]), [n for n in argv[2].split(",") if n])
    if served is None:
        os._exit(0)  # nothing of the server's needs finalizing, and torch's teardown takes a while
    from lockstep.launcher import worker

    worker.main(served)


if __name__ == "__main__":
    main(sys.argv[1:])
