"""The main-thread progress probe: it moves only when the main thread runs bytecode, and
what it queues on the main thread runs no Python, so an asynchronous exception raised
into the main thread (how the monitor thread restarts it) is never swallowed there."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stalwart.inprocess.progress import MainThreadProbe, ProgressClock
from tests.helpers import wait_for


class _Injected(Exception):
    pass


def _in_thread(fn: object) -> None:
    t = threading.Thread(target=fn)  # type: ignore[arg-type]
    t.start()
    t.join(10)
    assert not t.is_alive()


def _probe() -> MainThreadProbe:
    probe = MainThreadProbe.get()
    assert probe is not None
    return probe


def _ask(probe: MainThreadProbe) -> bool:
    box: list[bool] = []
    _in_thread(lambda: box.append(probe.ran()))
    return box[0]


def _main_in_pipe_read() -> bool:
    """The main thread is inside read(2) on a pipe: in C, the GIL released, running no
    bytecode until someone writes (the kernel's wait channel says so)."""
    tid = threading.main_thread().native_id
    try:
        return "pipe_read" in Path(f"/proc/self/task/{tid}/wchan").read_text()
    except OSError:
        return False


@contextmanager
def _main_blocked_while(looks: Callable[[], None]) -> Iterator[Callable[[], None]]:
    """Yields ``block``: the main thread calls it and sits in read(2) while a thread runs
    ``looks``, started only once the main thread is in the read and ending it by writing."""
    r, w = os.pipe()

    def look_then_release() -> None:
        try:
            wait_for(_main_in_pipe_read, 10, "the main thread to block in read(2)", 0.005)
            looks()
        finally:
            os.write(w, b"x")

    def block() -> None:
        os.read(r, 1)

    t = threading.Thread(target=look_then_release)
    try:
        t.start()
        yield block
    finally:
        t.join(10)
        os.close(r)
        os.close(w)
    assert not t.is_alive()


@pytest.mark.timeout(30)
def test_a_main_thread_blocked_in_c_is_not_progress_and_one_running_python_is() -> None:
    probe = _probe()
    answers: list[bool] = []

    def look_while_blocked() -> None:
        probe.ran()  # whatever came before; queues a request the blocked main cannot run
        answers.append(probe.ran())
        answers.append(_main_in_pipe_read())  # and the main thread was blocked throughout

    with _main_blocked_while(look_while_blocked) as block:
        block()
    assert answers == [False, True]
    deadline = time.monotonic() + 5
    ran = False
    while not ran and time.monotonic() < deadline:
        sum(range(1000))  # bytecode on the main thread runs the queued request
        ran = _ask(probe)
    assert ran


@pytest.mark.timeout(30)
def test_an_async_exception_is_raised_after_the_queued_request_not_swallowed() -> None:
    probe = _probe()
    main = threading.main_thread().ident
    assert main is not None

    raised: list[int] = []

    def queue_then_raise() -> None:
        probe.ran()  # the request waits for the main thread, blocked in C
        raised.append(
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(main), ctypes.py_object(_Injected)
            )
        )

    with _main_blocked_while(queue_then_raise) as block, pytest.raises(_Injected):
        block()
        for _ in range(1000):  # the exception lands at the first bytecode after the read
            sum(range(10))
    assert raised == [1]


@pytest.mark.timeout(30)
def test_the_clock_ticks_only_while_the_main_thread_runs_python() -> None:
    clock = ProgressClock()
    try:
        with clock.on_main_thread():
            stamps: list[float] = []

            def tick_twice_while_blocked() -> None:
                clock.tick()  # consumes what came before, queues a request
                stamps.append(time.monotonic() - clock.auto_age())
                time.sleep(0.05)  # not an order: a tick now would move the stamp past the bound
                clock.tick()  # the request has not run: no tick
                stamps.append(time.monotonic() - clock.auto_age())

            with _main_blocked_while(tick_twice_while_blocked) as block:
                block()
            assert len(stamps) == 2 and abs(stamps[1] - stamps[0]) < 0.01
            sum(range(1000))
            deadline = time.monotonic() + 5
            while clock.auto_age() > 0.2 and time.monotonic() < deadline:
                _in_thread(clock.tick)
            assert clock.auto_age() <= 0.2
        # Outside the wrapped function the thread's tick counts, whatever the main thread does.
        wait_for(lambda: clock.auto_age() > 0.3, 5, "the clock to age", 0.01)
        _in_thread(clock.tick)
        assert clock.auto_age() < 0.2
    finally:
        clock.close()
