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
    FillGaps,
    Mode,
    RankAssignment,
    RankDiscarded,
    RankShouldRestart,
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


@pytest.mark.parametrize(
    ("initial", "world", "terminated", "expected"),
    [
        # (initial rank, world, terminated) -> (mode, rank, world size)
        (2, 4, {1}, (Mode.ACTIVE, 1, 3)),
        (3, 4, {0, 2}, (Mode.ACTIVE, 1, 2)),
        (0, 4, set(), (Mode.ACTIVE, 0, 4)),
    ],
)
def test_shift_ranks_renumbers_survivors(
    initial: int, world: int, terminated: set[int], expected: tuple[Mode, int, int]
) -> None:
    placed, unplaced = ShiftRanks()(_state(initial, world), frozenset(terminated))
    assert (placed.mode, placed.rank, placed.world_size) == expected
    assert not unplaced  # NVIDIA's shape: every terminated rank accounted for


@pytest.mark.parametrize(
    ("initial", "world", "terminated", "expected"),
    [
        # Survivors below the new size keep their rank; the others fill the gaps in order.
        (2, 4, {1}, (Mode.ACTIVE, 2, 3)),
        (3, 4, {1}, (Mode.ACTIVE, 1, 3)),
        (0, 4, {1}, (Mode.ACTIVE, 0, 3)),
        (4, 5, {0, 2}, (Mode.ACTIVE, 2, 3)),
        (3, 5, {0, 2}, (Mode.ACTIVE, 0, 3)),
        (1, 5, {0, 2}, (Mode.ACTIVE, 1, 3)),
    ],
)
def test_fill_gaps_moves_fewest_ranks(
    initial: int, world: int, terminated: set[int], expected: tuple[Mode, int, int]
) -> None:
    placed, unplaced = FillGaps()(_state(initial, world), frozenset(terminated))
    assert (placed.mode, placed.rank, placed.world_size) == expected
    assert not unplaced


@pytest.mark.parametrize("assignment", [ShiftRanks(), FillGaps()])
def test_a_terminated_rank_is_discarded(assignment: RankAssignment) -> None:
    with pytest.raises(RankDiscarded, match="rank 1 of 4"):
        assignment(_state(1, 4), frozenset({1, 3}))


@pytest.mark.parametrize(
    ("initial", "world", "terminated", "expected"),
    [
        # ActiveWorldSize(2) after ShiftRanks -> (mode, rank, world size seen)
        (3, 4, {0}, (Mode.INACTIVE, 2, 2)),  # shifted to rank 2: still a spare
        (2, 3, set(), (Mode.INACTIVE, 2, 2)),
        (2, 3, {1}, (Mode.ACTIVE, 1, 2)),  # the spare takes the vanished rank's place
        (0, 3, set(), (Mode.ACTIVE, 0, 2)),
    ],
)
def test_active_world_size_makes_spares(
    initial: int, world: int, terminated: set[int], expected: tuple[Mode, int, int]
) -> None:
    shifted, _ = ShiftRanks()(_state(initial, world), frozenset(terminated))
    filtered = ActiveWorldSize(2)(shifted)
    assert (filtered.mode, filtered.rank, filtered.world_size) == expected


@pytest.mark.timeout(10)
def test_async_restart_waits_for_atomic_block_and_wakes_sleep() -> None:
    gate = AtomicGate()
    call = Call(_state(0, 1), gate=gate)
    restore = install_wake_handler()
    main = threading.get_ident()
    entered = threading.Event()
    held_off = threading.Event()
    order: list[str] = []

    def monitor() -> None:
        entered.wait()
        gate.pending = True
        while gate.depth > 0:
            held_off.set()
            time.sleep(0.001)
        order.append("fire")
        raise_in_thread(main, RankShouldRestart)
        wake(main)

    t = threading.Thread(target=monitor)
    t.start()
    try:
        with pytest.raises(RankShouldRestart):
            with call.atomic():
                entered.set()
                # The block ends only once the monitor has seen it and been held off.
                assert held_off.wait(10)
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
