"""The shape the house style asks of ``src/lockstep``: small functions.

A function's body is counted from its first statement (the docstring, if any) to its last line, so
a long signature such as the Trainer's, which mirrors Composer's arguments, does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lockstep"
LIMIT = 45


def long_bodies(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.body[0].lineno + 1
                if lines > LIMIT:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_body_is_over_45_lines() -> None:
    assert long_bodies(SRC) == []


def test_a_long_body_is_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT + 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_bodies(tmp_path / "pkg") == [f"pkg/m.py:5 long: {LIMIT + 1} lines"]
