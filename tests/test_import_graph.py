"""The import graph of ``src/lockstep``: no circle, and no module importing one above its layer.

The layers are those of docs/architecture.md, bottom-up. A module may import its own layer and
those below. Imports inside functions count, since they run too; so do imports that only type
checkers run (under ``if TYPE_CHECKING:``): a circle of them is still a circle for a reader. A new
module must be placed in a layer here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# module prefix -> layer; the longest matching prefix decides
LAYERS: dict[str, int] = {
    # 0: foundations that know nothing of processes or training
    "lockstep": 0, "lockstep.time": 0, "lockstep.batch": 0, "lockstep.checks": 0, "lockstep.progress": 0,
    "lockstep.idle": 0, "lockstep.rng": 0, "lockstep.optional": 0, "lockstep.objectstore": 0,
    "lockstep.errors": 0, "lockstep.dtensors": 0,
    # 1: processes: the launcher on one side, the ranks' collectives (and the elastic job's split of
    # the global batch over them) on the other
    "lockstep.launcher": 1, "lockstep.regroup": 1, "lockstep.dist": 1, "lockstep._agreement": 1, "lockstep.elastic": 1,
    # 2: the loop's vocabulary: state, model, events, callbacks, algorithms, devices, Composer's
    # utilities, models, metrics and losses
    "lockstep.state": 2, "lockstep.model": 2, "lockstep.core": 2, "lockstep.devices": 2, "lockstep.utils": 2,
    "lockstep.models": 2, "lockstep.metrics": 2, "lockstep.loss": 2,
    # 3: checkpoint files and layouts
    # Composer's paths for checkpoint helpers and inference export, which read checkpoints
    "lockstep.checkpoint": 3, "lockstep.utils.checkpoint": 3, "lockstep.utils.inference": 3,
    # 4: what a step does: backends (which name their checkpoint layout), optimizers, algorithms
    "lockstep.parallel": 4, "lockstep.optim": 4, "lockstep.algorithms": 4, "lockstep.functional": 4,
    # 5: what watches the loop: callbacks, logger destinations and the profiler
    "lockstep.callbacks": 5, "lockstep.loggers": 5, "lockstep.profiler": 5,
    # 6: the loop
    "lockstep.trainer": 6,
    # 7: entry points and test tools
    "lockstep.__main__": 7, "lockstep.testing": 7,
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((SRC / "lockstep").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _every_import(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            else:
                stack.append(child)
    return found


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        named = {alias.name for alias in node.names}
    else:
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        submodules = {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules}
        # `from package import name` depends on the package's __init__ unless every name is a submodule
        named = submodules if len(submodules) == len(node.names) else {module} | submodules
    named = {t for t in named if t.startswith("lockstep.") and t in modules and t != name}
    targets = set(named)
    for target in named:
        # importing a.b.c runs a.b's __init__ too, unless a.b already contains the importer
        parts = target.split(".")
        for i in range(2, len(parts)):
            ancestor = ".".join(parts[:i])
            if ancestor in modules and not name.startswith(ancestor + "."):
                targets.add(ancestor)
    return targets


def import_graph(*, for_types_too: bool = True) -> dict[str, set[str]]:
    """Who imports whom (``for_types_too=False``: only imports that run)."""
    modules = _modules()
    imports = _every_import if for_types_too else _runtime_imports
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_targets(name, path, n, modules) for n in imports(tree)))
    return graph


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix of ``module`` in LAYERS (the root package only by its own name)."""
    parts = module.split(".")
    for i in range(len(parts), 1, -1):
        prefix = ".".join(parts[:i])
        if prefix in LAYERS:
            return LAYERS[prefix]
    return LAYERS["lockstep"] if module == "lockstep" else None


def _layer(module: str) -> int:
    layer = layer_of(module)
    assert layer is not None, f"{module} has no layer in LAYERS"
    return layer


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    assert [m for m in _modules() if layer_of(m) is None] == []


def test_no_import_circle() -> None:
    assert _cycles(import_graph(for_types_too=False)) == []


def test_no_import_circle_even_through_imports_for_type_checkers() -> None:
    assert _cycles(import_graph()) == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = sorted(f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"
                    for src, targets in import_graph().items() for dst in targets
                    if _layer(dst) > _layer(src))
    assert upward == []


RANK_SIDE = {("lockstep.launcher.worker", "lockstep.regroup")}
"""The worker bootstrap runs in a rank, not in the launcher: once the rank's script has imported
torch, and only in an elastic job's rank that starts without some nodes or joins a running one, it
has the script's own init_process_group form the group of the ranks there are (regroup's)."""


def test_the_launcher_imports_only_itself_and_the_foundations() -> None:
    outside = sorted(f"{src} imports {dst}" for src, targets in import_graph().items()
                     if src.startswith("lockstep.launcher") for dst in targets
                     if not dst.startswith("lockstep.launcher") and _layer(dst) > 0 and (src, dst) not in RANK_SIDE)
    assert outside == []


def test_the_launcher_process_never_imports_the_rank_side() -> None:
    # what the exemption above allows runs in ranks only: the launcher itself loads none of it
    code = ("import sys; sys.argv = ['lockstep', '--help']; import lockstep.launcher.cli as c\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\n"
            "import lockstep.launcher.supervisor, lockstep.launcher.worker\n"
            "print(sorted(m for m in sys.modules if m in ('lockstep.regroup', 'lockstep.dist', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("source, expected", [
    ("import a\nfrom b import c\n", set()),
    ("from lockstep.core.callback import Callback\n", {"lockstep.core", "lockstep.core.callback"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lockstep.trainer import x\n", set()),
    ("def f():\n    from lockstep import dist\n", {"lockstep.dist"}),
    ("from lockstep.x import y\nfrom lockstep.core import Callback\n", {"lockstep.core"}),
])
def test_the_graph_reads_runtime_imports(tmp_path: Path, source: str, expected: set[str]) -> None:
    modules = {"lockstep.dist": Path(), "lockstep.core": Path(), "lockstep.core.callback": Path(),
               "lockstep.trainer": Path(), "lockstep.x": Path(), "lockstep.x.y": Path()}
    tree = ast.parse(source)
    path = tmp_path / "y.py"
    got = set().union(*(_targets("lockstep.x.y", path, n, modules) for n in _runtime_imports(tree)))
    assert got == expected


def test_a_circle_and_an_upward_import_are_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("lockstep.trainer.trainer") > _layer("lockstep.parallel.strategy")
    assert layer_of("lockstep.something_new") is None


def test_a_ddp_job_loads_neither_dcp_nor_dtensor_until_fsdp_needs_them() -> None:
    # each costs a process ~0.7 s of CPU (DTensor imports sympy); FSDP's layouts bring both
    code = ("import sys, lockstep, lockstep.trainer, lockstep.checkpoint.states, lockstep.checkpoint.deepspeed, "
            "lockstep.callbacks, lockstep.parallel.clipping; "
            "heavy = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor') if m in sys.modules]; "
            "assert not heavy, heavy; "
            "import lockstep.checkpoint.fsdp_states; assert 'torch.distributed.tensor' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

