"""Function lengths and branch counts of lockstep's source, for reviews of its structure.

    python scripts/code_metrics.py                  # the longest functions and the named ones
    python scripts/code_metrics.py --top 15 Trainer.__init__ load

A function's branches are its ``if``/``elif``, ternaries, ``for``/``while``, ``try`` handlers,
``match`` cases, boolean operators and comprehension conditions: a rough count of the paths a
reader follows.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "lockstep"
_BRANCHES = (ast.If, ast.IfExp, ast.For, ast.While, ast.ExceptHandler, ast.match_case, ast.BoolOp, ast.Assert)


def _branches(node: ast.AST) -> int:
    count = 0
    for child in ast.walk(node):
        if isinstance(child, _BRANCHES):
            count += 1
        elif isinstance(child, ast.comprehension):
            count += len(child.ifs)
    return count


def functions(root: Path = SRC) -> list[tuple[str, str, int, int]]:
    """(qualified name, file:line, lines, branches) of every function under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in [None, *[n for n in tree.body if isinstance(n, ast.ClassDef)]]:
            body = tree.body if cls is None else cls.body
            for fn in body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = fn.name if cls is None else f"{cls.name}.{fn.name}"
                    where = f"{path.relative_to(root.parent)}:{fn.lineno}"
                    found.append((name, where, fn.end_lineno - fn.lineno + 1, _branches(fn)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="functions to show, e.g. Trainer.__init__")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    rows = functions()
    lengths = sorted(r[2] for r in rows)
    print(f"{len(rows)} functions; median {lengths[len(lengths) // 2]} lines; "
          f"{sum(n > 40 for n in lengths)} over 40 lines")
    shown = sorted(rows, key=lambda r: -r[2])[:args.top] + [r for r in rows if r[0] in args.names]
    for name, where, length, branches in shown:
        print(f"{length:4d} lines {branches:3d} branches  {name}  ({where})")


if __name__ == "__main__":
    main()
