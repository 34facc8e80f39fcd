"""The launcher's stopping signals while its main thread runs Python code with no wait to poll
them in (loading torch): they end the work at once."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from lockstep.launcher.stopping import stopping_at_once
from lockstep.launcher.store import Stopped

pytestmark = pytest.mark.timeout(30)


def _signal_main_thread_after(seconds: float, signum: int) -> threading.Timer:
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signum))
    timer.start()
    return timer


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopping_signal_ends_python_work_at_once_even_through_except_exception(signum: int) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    started = time.monotonic()
    _signal_main_thread_after(0.2, signum)
    with pytest.raises(Stopped) as caught, stopping_at_once():
        while time.monotonic() - started < 20:  # as torch's optional imports, it swallows Exception
            try:
                sum(range(1000))
            except Exception:  # noqa: BLE001
                pass
    assert caught.value.signum == signum
    assert time.monotonic() - started < 5
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_handlers_are_put_back_when_the_work_ends_without_a_signal() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stopping_at_once():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(ValueError), stopping_at_once():
        raise ValueError("the work's own error passes through")
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_that_code_in_the_block_swallowed_still_ends_it_at_its_end() -> None:
    # torch's extension imports numpy and swallows whatever that import raised: an interruption too
    timer = _signal_main_thread_after(0.1, signal.SIGTERM)
    with pytest.raises(Stopped) as caught, stopping_at_once():
        try:
            timer.join()
            time.sleep(1)
        except BaseException:  # noqa: BLE001 - as C code that clears every error does
            pass
        swallowed = True
    assert swallowed and caught.value.signum == signal.SIGTERM
