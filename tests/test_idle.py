"""Background threads take CPU only where training leaves it idle (Linux's SCHED_IDLE)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from lockstep import idle


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own scheduling policy is Linux's")
def test_a_background_thread_is_made_idle_only_and_training_is_left_as_it_was() -> None:
    seen: list[int] = []

    def background() -> None:
        idle.yield_to_training()
        seen.append(os.sched_getscheduler(0))  # 0: the calling thread

    before = os.sched_getscheduler(0)
    thread = threading.Thread(target=background)
    thread.start()
    thread.join(timeout=10)
    assert seen == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == before


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own scheduling policy is Linux's")
def test_the_checkpoint_writer_and_logger_threads_yield_to_training(tmp_path) -> None:
    from lockstep.checkpoint.config import CheckpointConfig
    from lockstep.checkpoint.writer import CheckpointWriter
    from lockstep.checkpoint.layout import SHARDED, SINGLE
    from lockstep.loggers.background import BackgroundWriter

    def writer_policy(layout: str) -> tuple[int, int]:
        saver = CheckpointWriter(CheckpointConfig(save_folder=str(tmp_path / layout)), run_name="r",
                                max_duration=None, layout=layout)
        saver._hand_over(False, lambda: None)  # starts the lasting writer thread
        policy = saver._pool.submit(lambda: (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)))
        saver._pool.shutdown()
        return policy.result(timeout=10)

    assert writer_policy(SINGLE)[0] == os.SCHED_IDLE
    # a sharded folder's writers meet other ranks' in collectives: lower, but never idle-only
    policy, niceness = writer_policy(SHARDED)
    assert policy == os.SCHED_OTHER and niceness >= idle.FALLBACK_NICENESS
    writer, seen = BackgroundWriter("test", on_error=lambda e: None), []
    writer.submit(lambda: seen.append(os.sched_getscheduler(0)))
    writer.close()
    assert seen == [os.SCHED_IDLE]


def test_a_checkpoint_write_shortens_the_interpreter_lock_turns_until_it_ends(tmp_path) -> None:
    from lockstep.checkpoint.config import CheckpointConfig
    from lockstep.checkpoint.writer import CheckpointWriter

    before = sys.getswitchinterval()
    saver = CheckpointWriter(CheckpointConfig(save_folder=str(tmp_path)), run_name="r", max_duration=None)
    seen: list[float] = []

    def write() -> None:
        seen.append(sys.getswitchinterval())
        raise OSError("disk full")  # the interval is put back however the write ends

    saver._hand_over(False, write)
    with pytest.raises(OSError):
        saver._publisher.result(timeout=10)
    saver._pool.shutdown()
    assert seen == [min(before, idle.SWITCH_INTERVAL)] and seen[0] < 0.005
    assert sys.getswitchinterval() == before
