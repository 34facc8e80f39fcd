"""``python -m lockstep`` is the ``lockstep`` launcher."""

from lockstep.launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
