"""The runner's parts on their own, in one process: the fault handling and the ending,
their decisions as tables, their store records over an in-memory store."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from torch._C._distributed_c10d import HashStore, Store

from stalwart.base.liveness import CounterWatch
from stalwart.inprocess import State
from stalwart.inprocess.errors import HealthCheckError, HookError, InternalError
from stalwart.inprocess.groups import GroupKeeper
from stalwart.inprocess.iteration_stores import IterationStores
from stalwart.inprocess.options import Options
from stalwart.inprocess.progress import ProgressClock
from stalwart.inprocess.runner_ending import (
    Ending,
    HostWait,
    host_wait,
    still_pending,
    stops_background_first,
)
from stalwart.inprocess.runner_faults import (
    FaultHandling,
    drop_tracebacks,
    expect_state,
    hook_failed,
    interruption_record,
)
from stalwart.inprocess.state import Interruption, InterruptionRecord
from stalwart.inprocess.store import CoordStore

pytestmark = pytest.mark.timeout(60)

RUNNER_LOG = "stalwart.inprocess.runner"


def _state(rank: int = 1, world: int = 3, iteration: int = 2) -> State:
    return State(
        rank=rank,
        world_size=world,
        initial_rank=rank,
        initial_world_size=world,
        iteration=iteration,
    )


def _coord(store: Store, rank: int, liveness: float = 60.0) -> CoordStore:
    return CoordStore(store, rank, CounterWatch[int](liveness))


@pytest.fixture
def clock() -> Iterator[ProgressClock]:
    c = ProgressClock()
    yield c
    c.close()


class _BrokenStore(Store):
    """A store every call of which fails, as one whose host has gone."""

    def set(self, key: str, value: object) -> None:
        raise RuntimeError("store is gone")

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        raise RuntimeError("store is gone")


# -- decisions ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "leaving", "kind"),
    [
        (ValueError("boom"), False, Interruption.EXCEPTION),
        (HookError("initialize", 1, 2, ValueError("boom")), False, Interruption.HOOK),
        (HealthCheckError("health_check", 1, 2, ValueError("boom")), False, Interruption.HOOK),
        (KeyboardInterrupt("boom"), True, Interruption.BASE_EXCEPTION),
        (ValueError("boom"), True, Interruption.BASE_EXCEPTION),
        (HookError("abort", 1, 2, ValueError("boom")), True, Interruption.BASE_EXCEPTION),
    ],
)
def test_interruption_record_kind(exc: BaseException, leaving: bool, kind: Interruption) -> None:
    record = interruption_record(_state(rank=1, iteration=2), exc, leaving=leaving)
    assert record == InterruptionRecord(1, 2, kind, f"{type(exc).__name__}: {exc}")


def test_interruption_record_names_the_initial_rank() -> None:
    state = State(rank=0, world_size=2, initial_rank=3, initial_world_size=4, iteration=5)
    record = interruption_record(state, ValueError("x"))
    assert (record.rank, record.iteration) == (3, 5)


@pytest.mark.parametrize(
    ("clean", "last_call_wait", "now", "expected"),
    [
        (True, 5.0, 100.0, HostWait(deadline=105.0, poll=0.01)),
        (True, 0.0, 7.0, HostWait(deadline=7.0, poll=0.01)),
        (False, 5.0, 100.0, HostWait(deadline=None, poll=0.005)),
    ],
)
def test_host_wait(clean: bool, last_call_wait: float, now: float, expected: HostWait) -> None:
    assert host_wait(clean, last_call_wait, now) == expected


@pytest.mark.parametrize(
    ("clean", "is_host", "first"),
    [(True, True, True), (True, False, True), (False, False, True), (False, True, False)],
)
def test_stops_background_first(clean: bool, is_host: bool, first: bool) -> None:
    assert stops_background_first(clean, is_host) is first


@pytest.mark.parametrize(
    ("pending", "done", "left"),
    [
        ([1, 2, 3], set(), [1, 2, 3]),
        ([1, 2, 3], {2}, [1, 3]),
        ([3, 1], {1, 3}, []),
        ([], {1}, []),
    ],
)
def test_still_pending(pending: list[int], done: set[int], left: list[int]) -> None:
    assert still_pending(pending, done.__contains__) == left


def test_drop_tracebacks_walks_a_cyclic_chain() -> None:
    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:
            return caught

    first = raised(ValueError("first"))
    second = raised(RuntimeError("second"))
    second.__cause__ = first
    first.__context__ = second  # a cycle: the walk must end
    drop_tracebacks(second)
    assert first.__traceback__ is None and second.__traceback__ is None


def test_expect_state() -> None:
    state = _state()
    assert expect_state("initialize", state) is state
    with pytest.raises(InternalError, match="initialize must return a State or None, got dict"):
        expect_state("initialize", {"rank": 1})


def test_hook_failed_raises_a_hook_error_from_the_cause() -> None:
    cause = ValueError("bad")
    with pytest.raises(HookError, match="initialize hook failed on rank 1 in iteration 2") as info:
        hook_failed("initialize", _state(), cause)
    assert info.value.__cause__ is cause


# -- FaultHandling ----------------------------------------------------------------------
def test_record_raises_the_fault_flag_first_record_wins(clock: ProgressClock) -> None:
    store = HashStore()
    faults = FaultHandling(Options(abort=None), _coord(store, 1), GroupKeeper(), clock)
    faults.record(_state(rank=1), HookError("initialize", 1, 2, ValueError("x")))
    FaultHandling(Options(abort=None), _coord(store, 2), GroupKeeper(), clock).record_exit(
        _state(rank=2), KeyboardInterrupt()
    )
    peer = _coord(store, 0)
    fault = peer.fault(2)
    assert fault is not None and (fault.rank, fault.kind) == (1, Interruption.HOOK)
    kinds = {r.rank: r.kind for r in peer.interruptions(2, range(3))}
    assert kinds == {1: Interruption.HOOK, 2: Interruption.BASE_EXCEPTION}


def test_record_survives_a_store_that_is_gone(
    clock: ProgressClock, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultHandling(Options(abort=None), _coord(_BrokenStore(), 1), GroupKeeper(), clock)
    with caplog.at_level(logging.ERROR, logger=RUNNER_LOG):
        faults.record(_state(), ValueError("x"))
        faults.record_exit(_state(), SystemExit(3))
    messages = [r.getMessage() for r in caplog.records if r.name == RUNNER_LOG]
    assert messages == ["could not record the interruption in the store"] * 2


@pytest.mark.parametrize("aborted", [False, True])
def test_report_runs_abort_unless_done(
    aborted: bool, clock: ProgressClock, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def abort(state: State) -> State:
        calls.append(state.rank)
        return state

    faults = FaultHandling(Options(abort=abort), _coord(HashStore(), 1), GroupKeeper(), clock)
    try:
        raise ValueError("boom")
    except ValueError as exc:
        error = exc
    with caplog.at_level(logging.WARNING, logger=RUNNER_LOG):
        faults.report(_state(), error, aborted=aborted)
    assert calls == ([] if aborted else [1])
    assert error.__traceback__ is None
    assert "rank 1 iteration 2 failed: ValueError: boom" in caplog.text


def test_report_turns_a_failing_abort_into_a_hook_error(clock: ProgressClock) -> None:
    def abort(state: State) -> State:
        raise OSError("cannot abort")

    faults = FaultHandling(Options(abort=abort), _coord(HashStore(), 1), GroupKeeper(), clock)
    with pytest.raises(HookError, match="abort hook failed on rank 1 in iteration 2") as info:
        faults.report(_state(), ValueError("boom"), aborted=False)
    assert isinstance(info.value.__cause__, OSError)


def test_after_fault_runs_finalize_then_health_check_with_the_fault(clock: ProgressClock) -> None:
    seen: list[tuple[str, BaseException | None]] = []
    opts = Options(
        abort=None,
        finalize=lambda s, e: seen.append(("finalize", e)),
        health_check=lambda s, e: seen.append(("health_check", e)),
    )
    faults = FaultHandling(opts, _coord(HashStore(), 1), GroupKeeper(), clock)
    error = ValueError("boom")
    faults.after_fault(_state(), error)
    assert seen == [("finalize", error), ("health_check", error)]


def test_finalize_raises_its_own_exception_chained_and_noted(clock: ProgressClock) -> None:
    def finalize(state: State, error: BaseException | None) -> None:
        raise KeyError("from finalize")

    faults = FaultHandling(
        Options(abort=None, finalize=finalize), _coord(HashStore(), 1), GroupKeeper(), clock
    )
    fault = ValueError("boom")
    with pytest.raises(KeyError) as info:
        faults.finalize(_state(), fault)
    assert info.value.__cause__ is fault
    assert info.value.__notes__ == [
        "stalwart: raised by the finalize hook on rank 1 in iteration 2"
    ]
    with pytest.raises(KeyError) as clean:
        faults.finalize(_state(), None)
    assert clean.value.__cause__ is None


def test_failing_health_check_is_a_health_check_error(clock: ProgressClock) -> None:
    def check(state: State, error: BaseException | None) -> None:
        raise RuntimeError("gpu fell off")

    faults = FaultHandling(
        Options(abort=None, health_check=check), _coord(HashStore(), 1), GroupKeeper(), clock
    )
    with pytest.raises(HealthCheckError, match="RuntimeError: gpu fell off"):
        faults.health_check(_state(), None)
    quiet = FaultHandling(Options(abort=None), _coord(HashStore(), 1), GroupKeeper(), clock)
    quiet.health_check(_state(), None)  # no hook: nothing to do


# -- Ending -----------------------------------------------------------------------------
class _Background:
    def __init__(self, name: str, stopped: list[str]) -> None:
        self.name = name
        self.stopped = stopped

    def stop(self) -> None:
        self.stopped.append(self.name)


def _ending(
    store: Store, rank: int, stopped: list[str], last_call_wait: float = 0.2
) -> tuple[Ending, IterationStores]:
    stores = IterationStores()
    parts = [_Background(n, stopped) for n in ("monitor_process", "ticker", "heartbeat")]
    ending = Ending(_coord(store, rank), rank == 0, stores, GroupKeeper(), parts, last_call_wait)
    return ending, stores


def test_finish_on_a_peer_stops_the_background_and_announces_leaving() -> None:
    store = HashStore()
    stopped: list[str] = []
    ending, _ = _ending(store, 1, stopped)
    ending.finish(_state(rank=1), clean=True)
    assert stopped == ["monitor_process", "ticker", "heartbeat"] * 2
    assert _coord(store, 0).has_left(1)


def test_a_host_finishing_waits_for_its_peers_then_gives_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = HashStore()
    _coord(store, 2).record_left()
    stopped: list[str] = []
    ending, stores = _ending(store, 0, stopped, last_call_wait=0.2)
    with caplog.at_level(logging.WARNING, logger=RUNNER_LOG):
        ending.finish(_state(rank=0, world=3), clean=True)
    stores.close()
    assert "store host stops waiting for ranks [1] to leave" in caplog.text
    assert _coord(store, 1).has_left(0)


def test_a_host_leaving_early_serves_the_next_iteration_store_once() -> None:
    store = HashStore()
    ending, stores = _ending(store, 0, [])
    try:
        ending.serve_port(3)
        port = _coord(store, 1).port(3)
        assert port is not None and port > 0
        ending.serve_port(3)
        assert _coord(store, 1).port(3) == port
    finally:
        stores.close()


def test_leave_abnormally_marks_the_rank_terminated() -> None:
    store = HashStore()
    ending, _ = _ending(store, 1, [])
    ending.leave_abnormally(_state(rank=1, iteration=4), SystemExit(2))
    peer = _coord(store, 0)
    assert peer.is_terminated(1)
    fault = peer.fault(4)
    assert fault == InterruptionRecord(1, 4, Interruption.BASE_EXCEPTION, "SystemExit: 2")


def test_log_interruptions_clips_an_oversized_record(caplog: pytest.LogCaptureFixture) -> None:
    store = HashStore()
    # Long, yet within the size a record can have (a larger one is refused unread:
    # tests/reliability/test_strangers_inprocess.py).
    huge = "x" * 10_000
    forged = {"rank": 1, "iteration": 2, "kind": Interruption.EXCEPTION.value, "message": huge}
    _coord(store, 1).store.set("it2/int/1", json.dumps(forged))
    ending, _ = _ending(store, 0, [])
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
        ending.log_interruptions(_state(rank=0, world=3, iteration=2))
    (line,) = [r.getMessage() for r in caplog.records if r.name == RUNNER_LOG]
    assert line == f"iteration 2 interrupted by initial rank 1: exception {'x' * 300}"


@pytest.mark.parametrize(
    "forged",
    ["not json", '{"rank": 1}', '{"rank": 1, "iteration": 2, "kind": "nonsense"}', "[]"],
)
def test_log_interruptions_ignores_a_forged_record(
    forged: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = HashStore()
    _coord(store, 1).store.set("it2/int/1", forged)
    ending, _ = _ending(store, 0, [])
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
        ending.log_interruptions(_state(rank=0, world=3, iteration=2))
    assert not [r for r in caplog.records if r.name == RUNNER_LOG]


# -- the shape ----------------------------------------------------------------------------
def test_no_inprocess_class_is_assembled_from_other_modules_classes() -> None:
    import importlib
    import inspect
    import pkgutil

    import stalwart.inprocess as package

    assembled = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            foreign = [
                b
                for b in cls.__bases__
                if b.__module__.startswith("stalwart.") and b.__module__ != cls.__module__
            ]
            if len(foreign) > 1:
                assembled.append(cls.__qualname__)
    assert assembled == []
    from stalwart.inprocess.runner import Runner

    assert Runner.__bases__ == (object,)
