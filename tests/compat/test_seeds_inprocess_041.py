"""NVIDIA ``inprocess`` 0.4's API on ``stalwart.inprocess`` (issue 26 item 1): rank
assignments called with one ``RankAssignmentCtx``; ``finalize(state)``,
``health_check(state)`` and ``rank_assignment(ctx)`` hooks of one argument;
``finalize`` and ``health_check`` given a read-only ``State``; the
``progress_watchdog`` module; ``FilterCountGroupedByKey``; the monitor process's ``target_pid`` wording."""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import threading
import time
from collections.abc import Set
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import stalwart.inprocess as inprocess
from stalwart.inprocess import assignment
from stalwart.inprocess.assignment import call_assignment
from stalwart.inprocess.errors import (
    ConfigError,
    HealthCheckError,
    InternalError,
    RankDiscarded,
    RestartError,
)
from stalwart.inprocess.hooks import check_hook, hook_arity
from stalwart.inprocess.options import Options
from stalwart.inprocess.progress_watchdog import ProgressWatchdog, Timestamp
from stalwart.inprocess.rank_assignment import (
    FillGaps,
    FilterCountGroupedByKey,
    RankAssignmentCtx,
    ShiftRanks,
)
from stalwart.inprocess.runner_faults import FaultHandling
from stalwart.inprocess.state import State
from tests.inprocess.harness import launch

PROGRAM = Path(__file__).parent / "programs" / "seeds_inprocess_041.py"


def _ranks_after(assignment: Any, world: int, terminated: Set[int]) -> dict[int, int | None]:
    out: dict[int, int | None] = {}
    for rank in range(world):
        ctx = RankAssignmentCtx(State(rank, world), None, set(terminated))
        try:
            placed = assignment(ctx)
        except RankDiscarded:
            out[rank] = None
            continue
        assert isinstance(placed, RankAssignmentCtx)
        assert placed.terminated_ranks == set()
        assert placed.state.world_size == world - len(terminated)
        out[rank] = placed.state.rank
    return out


@pytest.mark.parametrize(
    ("assignment", "world", "terminated", "expected"),
    [
        (ShiftRanks(), 8, {1, 4, 5}, {0: 0, 1: None, 2: 1, 3: 2, 4: None, 5: None, 6: 3, 7: 4}),
        (ShiftRanks(), 4, set(), {0: 0, 1: 1, 2: 2, 3: 3}),
        (ShiftRanks(), 3, {0, 1, 2}, {0: None, 1: None, 2: None}),
        (FillGaps(), 8, {1, 2, 7}, {0: 0, 1: None, 2: None, 3: 3, 4: 4, 5: 1, 6: 2, 7: None}),
        (FillGaps(), 4, set(), {0: 0, 1: 1, 2: 2, 3: 3}),
        (FillGaps(), 3, {0, 1, 2}, {0: None, 1: None, 2: None}),
    ],
)
def test_built_in_assignments_take_and_give_a_ctx(
    assignment: Any, world: int, terminated: set[int], expected: dict[int, int | None]
) -> None:
    assert _ranks_after(assignment, world, terminated) == expected


def test_a_ctx_keeps_its_store_and_a_second_pass_changes_nothing() -> None:
    store = object()
    first = ShiftRanks()(RankAssignmentCtx(State(5, 8), store, {1, 2, 7}))
    second = ShiftRanks()(first)
    assert first.store is store and second.store is store
    assert (second.state.rank, second.state.world_size) == (3, 5)
    assert second.terminated_ranks == set()


def test_the_two_argument_form_still_answers_a_pair() -> None:
    state, rest = FillGaps()(State(6, 8), {1, 2, 7})
    assert (state.rank, state.world_size, set(rest)) == (2, 5, set())
    with pytest.raises(TypeError, match="alone"):
        ShiftRanks()(RankAssignmentCtx(State(0, 2), None, set()), set())  # type: ignore[call-overload]


class _CtxAssignment(inprocess.rank_assignment.RankAssignment):  # type: ignore[misc]
    def __init__(self, answer: Any = None) -> None:
        self.answer = answer
        self.seen: list[RankAssignmentCtx] = []

    def __call__(self, ctx: RankAssignmentCtx) -> Any:  # type: ignore[override]
        self.seen.append(ctx)
        return ShiftRanks()(ctx) if self.answer is None else self.answer


def test_the_wrapper_runs_a_one_argument_assignment_with_its_store() -> None:
    store = object()
    custom = _CtxAssignment()
    state, rest = call_assignment(custom, State(3, 4), {1}, store)
    assert (state.rank, state.world_size, rest) == (2, 3, set())
    assert custom.seen[0].store is store and custom.seen[0].terminated_ranks == {1}


@pytest.mark.parametrize(
    "answer", [(State(0, 1), set()), "ctx", RankAssignmentCtx("x", None, set())]
)  # type: ignore[arg-type]
def test_a_one_argument_assignment_answering_anything_else_is_an_internal_error(
    answer: Any,
) -> None:
    with pytest.raises(InternalError, match="must return a RankAssignmentCtx"):
        call_assignment(_CtxAssignment(answer), State(0, 2), set(), None)


def _one(state: Any) -> None: ...
def _two(state: Any, error: Any) -> None: ...
def _none() -> None: ...
def _three(a: Any, b: Any, c: Any) -> None: ...


@pytest.mark.parametrize(
    ("name", "hook", "arity"),
    [
        ("finalize", _two, 2),
        ("finalize", _one, 1),
        ("health_check", _one, 1),
        ("health_check", _two, 2),
        ("rank_assignment", _two, 2),
        ("rank_assignment", _one, 1),
        ("initialize", _one, 1),
        ("initialize", _two, None),
        ("finalize", _none, None),
        ("health_check", _three, None),
    ],
)
def test_hook_shapes_of_0_2_and_0_4_are_told_apart(name: str, hook: Any, arity: int | None) -> None:
    assert hook_arity(name, hook) == arity
    if arity is None:
        with pytest.raises(ConfigError, match=f"{name} must be callable as"):
            check_hook(name, hook)
    else:
        check_hook(name, hook)


@pytest.mark.timeout(120)
def test_one_argument_hooks_run_in_a_restarting_job() -> None:
    """Two ranks (a program without a ``__main__`` guard), one fault: 0.4-shaped finalize,
    health_check and rank_assignment hooks run on both ranks in both iterations."""
    results = launch("-", world_size=2, timeout=100, program=PROGRAM)
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
        assert r.of("result")[-1]["value"] == 1, r.output[-3000:]
        assert [e["iteration"] for e in r.of("finalize")][:1] == [0], r.output[-3000:]
        assert {e["iteration"] for e in r.of("health_check")} == {0, 1}
        placed = r.of("assignment")
        assert len(placed) == 2 and all(e["ctx"] == "RankAssignmentCtx" for e in placed)
        assert all(e["rank"] == r.rank and e["world_size"] == 2 for e in placed)


class _Collect:
    def __init__(self) -> None:
        self.sent: list[Timestamp] = []
        self.lock = threading.Lock()

    def send_timestamp(self, timestamp: Timestamp) -> None:
        with self.lock:
            self.sent.append(Timestamp(timestamp.auto, timestamp.manual))

    def count(self) -> int:
        with self.lock:
            return len(self.sent)


def _wait_for(predicate: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


@pytest.mark.timeout(30)
def test_the_watchdog_sees_a_main_thread_blocked_in_c_as_not_running() -> None:
    """While the main thread sleeps in C the watchdog keeps sending, but the time it
    sends stays at or before the sleep's start; a pause sends nothing; a ping sets
    ``manual``; after shutdown, ``resume`` is refused and a second shutdown is a no-op."""
    sink = _Collect()
    watchdog = ProgressWatchdog(0, sink, timedelta(milliseconds=2))
    watchdog.start()
    _wait_for(lambda: sink.count() > 5)
    before_sleep = time.monotonic()
    first = sink.count()
    time.sleep(0.3)  # no bytecode runs on this thread meanwhile
    during = sink.sent[first : sink.count()]
    assert len(during) > 5
    # A request queued just before the sleep may be collected during it: a margin of
    # 0.05 s, against the 0.3 s the wall clock moved meanwhile.
    assert all(t.auto is not None and t.auto <= before_sleep + 0.05 for t in during)
    _wait_for(lambda: (sink.sent[-1].auto or 0.0) > before_sleep)
    watchdog.pause_and_synchronize()
    paused = sink.count()
    time.sleep(0.05)
    assert sink.count() == paused
    assert sink.sent[-1].manual is None
    watchdog.ping()
    assert sink.sent[-1].manual is not None
    watchdog.resume()
    _wait_for(lambda: sink.count() > paused + 3)
    watchdog.shutdown()
    assert not watchdog.is_alive()
    ended = sink.count()
    watchdog.shutdown()
    assert sink.count() == ended
    with pytest.raises(RuntimeError, match="not running"):
        watchdog.resume()
    assert Timestamp(auto=time.monotonic() - 5).is_timed_out(timedelta(seconds=1))
    assert not Timestamp(auto=time.monotonic()).is_timed_out(timedelta(seconds=1))


@pytest.mark.parametrize("interval", [timedelta(0), timedelta(seconds=-1), "1s"])
def test_the_watchdog_refuses_an_interval_that_is_not_positive(interval: Any) -> None:
    with pytest.raises(ValueError, match="interval must be a positive timedelta"):
        ProgressWatchdog(0, _Collect(), interval)


def test_a_frozen_state_refuses_changes_and_keeps_every_field() -> None:
    state = State(3, 8, initial_rank=5, initial_world_size=9, iteration=2)
    frozen = state.freeze()
    assert isinstance(frozen, State)
    assert dataclasses.astuple(frozen) == dataclasses.astuple(state)
    with pytest.raises(dataclasses.FrozenInstanceError, match="'rank'"):
        frozen.rank = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        del frozen.iteration
    moved = dataclasses.replace(frozen, rank=1)
    assert moved.rank == 1 and frozen.rank == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved.rank = 2


def _mutates(state: State) -> State:
    state.rank = 0
    return state


@pytest.mark.parametrize("hook", ["finalize", "health_check"])
def test_finalize_and_health_check_cannot_change_the_wrappers_state(hook: str) -> None:
    """As in NVIDIA 0.4 these hooks get a read-only copy: a change in place fails in the
    hook instead of silently renumbering the rank the wrapper goes on with."""
    faults = FaultHandling(Options(**{hook: _mutates}), None, None, None)  # type: ignore[arg-type]
    state = State(3, 4)
    expected = dataclasses.FrozenInstanceError if hook == "finalize" else HealthCheckError
    with pytest.raises(expected):
        getattr(faults, hook)(state, RuntimeError("fault"))
    assert state.rank == 3


def _filter_rank(path: str, rank: int, world: int, terminated: set[int], out: Any) -> None:
    store = inprocess.store.FileStore(path, -1)
    keep_pairs = FilterCountGroupedByKey(
        key_or_fn=lambda s: s.rank // 2, condition=lambda n: n == 2
    )
    ctx = keep_pairs(RankAssignmentCtx(State(rank, world), store, set(terminated)))
    out.put((rank, sorted(ctx.terminated_ranks), ctx.state.rank))


@pytest.mark.timeout(60)
def test_grouped_by_key_drops_every_group_short_of_its_count(tmp_path: Path) -> None:
    """Ranks as processes exchanging keys through a real FileStore: with rank 1 of 6
    gone, the pair {0, 1} has one survivor and is dropped whole; the others stay."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_filter_rank, args=(str(tmp_path / "fs"), r, 6, {1}, out))
        for r in (0, 2, 3, 4, 5)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    seen = sorted(out.get(timeout=5) for _ in procs)
    assert seen == [(r, [0, 1], r) for r in (0, 2, 3, 4, 5)]


@pytest.mark.parametrize(
    ("forged", "message"),
    [
        (b"\xff{not json", r"rank 1's group key .* is not JSON"),
        (b"1" * 5000, "rank 1's group key is 5000 bytes, over 4096"),
    ],
)
def test_grouped_by_key_refuses_a_forged_peer_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forged: bytes, message: str
) -> None:
    """A stranger who can write the store puts garbage where rank 1's key goes."""
    monkeypatch.setattr(assignment, "_filter_calls", itertools.count(7))
    store = inprocess.store.FileStore(str(tmp_path / "fs"), -1)
    store.set("stalwart/filter_count/7/2/1", forged)
    keep = FilterCountGroupedByKey(key_or_fn=0, condition=lambda n: n == 2)
    with pytest.raises(RestartError, match=message):
        keep(RankAssignmentCtx(State(0, 2), store, set()))


def test_grouped_by_key_waits_for_a_silent_peer_no_longer_than_its_timeout(
    tmp_path: Path,
) -> None:
    store = inprocess.store.FileStore(str(tmp_path / "fs"), -1)
    keep = FilterCountGroupedByKey(0, lambda n: n == 2, timeout=timedelta(milliseconds=200))
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        keep(RankAssignmentCtx(State(0, 2), store, set()))
    assert time.monotonic() - start < 10


def test_grouped_by_key_refuses_a_key_that_is_not_json(tmp_path: Path) -> None:
    keep = FilterCountGroupedByKey(object(), lambda n: True)
    store = inprocess.store.FileStore(str(tmp_path / "fs"), -1)
    with pytest.raises(ValueError, match=r"group key .* of rank 0 is not JSON"):
        keep(RankAssignmentCtx(State(0, 1), store, set()))
