"""``python -m lockstep.checkpoint export CHECKPOINT OUT.safetensors``."""

from __future__ import annotations

import argparse
import sys

from lockstep.checkpoint.export import export_safetensors
from lockstep.checkpoint.files import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lockstep.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write a checkpoint's model weights as safetensors")
    export.add_argument("checkpoint")
    export.add_argument("out")
    args = parser.parse_args(argv)
    try:
        out = export_safetensors(args.checkpoint, args.out)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
