"""Configuration errors: one line for the job, no traceback.

A mistake in what a script asks of lockstep (a wrong argument, a bad config, a missing optional
package) is raised while the Trainer is built or ``fit``'s arguments are applied, by lockstep's
own checks, with a message that says what to change. Such an error keeps its type (a ``ValueError`` stays one, as Composer's tests and
users' ``except`` clauses expect) and is marked as a configuration error; where it ends the
process, it is printed as one line, ``lockstep: error: <message>``, instead of a traceback:

* under the launcher, the rank writes it to its error file (``TORCHELASTIC_ERROR_FILE``, with the
  traceback) and prints nothing; the launcher prints the line once for the job and does not
  restart (the same error would come back);
* in a plain ``python train.py``, through ``sys.excepthook``.

``LOCKSTEP_VERBOSE=1`` (``lockstep -v`` sets it for the ranks) shows the traceback as usual.
Only the standard library is imported here: the launcher's worker bootstrap reads the mark.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Iterator
from types import TracebackType

MARK = "lockstep_configuration"
"""The attribute a configuration error carries (True), and the key of the error file that says so."""
_KINDS = (ValueError, TypeError, ImportError, FileExistsError)
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def verbose() -> bool:
    """Whether tracebacks are wanted (``LOCKSTEP_VERBOSE``)."""
    return os.environ.get("LOCKSTEP_VERBOSE", "") not in ("", "0")


def is_configuration_error(error: BaseException) -> bool:
    return bool(getattr(error, MARK, False))


def one_line(error: BaseException) -> str:
    """``lockstep: error: <the message's first line>``."""
    text = str(error).strip().splitlines()
    return f"lockstep: error: {text[0] if text else type(error).__name__}"


@contextlib.contextmanager
def configuration_checks() -> Iterator[None]:
    """Mark a ValueError, TypeError, ImportError or FileExistsError that lockstep's own code raises
    inside as a configuration error (one raised in torch or in the user's code is not one)."""
    try:
        yield
    except _KINDS as e:
        if _raised_by_lockstep(e.__traceback__) and not is_configuration_error(e):
            setattr(e, MARK, True)
            _install_hook()
        raise


def _raised_by_lockstep(tb: TracebackType | None) -> bool:
    """Raised by a ``raise`` statement of lockstep's (not by Python itself inside lockstep: a bug,
    whose traceback matters)."""
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    path = os.path.abspath(last.tb_frame.f_code.co_filename)
    return path.startswith(_PACKAGE) and linecache.getline(path, last.tb_lineno).lstrip().startswith("raise")


def _install_hook() -> None:
    previous = sys.excepthook
    if getattr(previous, MARK, False):
        return

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if is_configuration_error(error) and not verbose():
            print(one_line(error), file=sys.stderr, flush=True)
        else:
            previous(kind, error, tb)

    setattr(hook, MARK, True)
    sys.excepthook = hook
