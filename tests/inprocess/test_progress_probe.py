"""The main-thread progress probe: it moves only when the main thread runs bytecode, and
what it queues on the main thread runs no Python, so an asynchronous exception raised
into the main thread (how the monitor thread restarts it) is never swallowed there."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from stalwart.inprocess.progress import MainThreadProbe, ProgressClock


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


@pytest.mark.timeout(30)
def test_a_main_thread_blocked_in_c_is_not_progress_and_one_running_python_is() -> None:
    probe = _probe()
    answers: list[bool] = []

    def look_while_blocked() -> None:
        time.sleep(0.1)
        probe.ran()  # whatever came before; queues a request the sleeping main cannot run
        time.sleep(0.1)
        answers.append(probe.ran())

    t = threading.Thread(target=look_while_blocked)
    t.start()
    time.sleep(1.0)  # in C, GIL released; the looks are done well before it ends
    t.join(10)
    assert answers == [False]
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

    def queue_then_raise() -> None:
        time.sleep(0.05)
        probe.ran()  # the request waits for the main thread, asleep in C
        n = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(main), ctypes.py_object(_Injected)
        )
        assert n == 1

    t = threading.Thread(target=queue_then_raise)
    t.start()
    with pytest.raises(_Injected):
        time.sleep(0.5)
        for _ in range(1000):  # the exception lands at the first bytecode after the sleep
            time.sleep(0.001)
    t.join(10)


@pytest.mark.timeout(30)
def test_the_clock_ticks_only_while_the_main_thread_runs_python() -> None:
    clock = ProgressClock()
    try:
        with clock.on_main_thread():
            stamps: list[float] = []

            def tick_twice_while_blocked() -> None:
                time.sleep(0.1)
                clock.tick()  # consumes what came before, queues a request
                stamps.append(time.monotonic() - clock.auto_age())
                time.sleep(0.1)
                clock.tick()  # the request has not run: no tick
                stamps.append(time.monotonic() - clock.auto_age())

            t = threading.Thread(target=tick_twice_while_blocked)
            t.start()
            time.sleep(1.0)  # in C, GIL released; both ticks come well before it ends
            t.join(10)
            assert len(stamps) == 2 and abs(stamps[1] - stamps[0]) < 0.01
            sum(range(1000))
            deadline = time.monotonic() + 5
            while clock.auto_age() > 0.2 and time.monotonic() < deadline:
                _in_thread(clock.tick)
            assert clock.auto_age() <= 0.2
        # Outside the wrapped function the thread's tick counts, whatever the main thread does.
        time.sleep(0.3)
        _in_thread(clock.tick)
        assert clock.auto_age() < 0.2
    finally:
        clock.close()
