"""The right rank blamed: when several ranks of a node hang, the one whose progress
stopped first is the root cause and the others are reported as waiting on it."""

from __future__ import annotations

import pytest

from stalwart.launch.round.hangs import _blame_first
from stalwart.launch.workers.failures import root_cause
from stalwart.monitor import HangKind, HangReport, MonitorConfig
from stalwart.monitor.judge import Stalled, blame, judge
from stalwart.rendezvous.api import WorkerFailed
from tests.helpers import wait_for

from .conftest import Harness
from .test_hangs import fast
from .test_judge import opened, slot


def s(
    local: int,
    iteration: int | None,
    since: float | None,
    rank: int | None = None,
    active: float | None = None,
    stopped: bool = False,
) -> Stalled:
    return Stalled(local, local if rank is None else rank, iteration, since, active, stopped)


@pytest.mark.parametrize(
    ("stalled", "root"),
    [
        # the case: rank 1 asleep at iteration 79, rank 0 blocked at 80
        ([s(0, 80, 10.026), s(1, 79, 10.0)], 1),
        # lower iteration wins even when its heartbeat is younger (clock skew of writes)
        ([s(0, 80, 10.0), s(1, 79, 10.5)], 1),
        # same iteration: the oldest heartbeat
        ([s(0, 5, 10.2), s(1, 5, 10.1), s(2, 5, 10.3)], 1),
        # no iterations reported by someone: heartbeat age alone
        ([s(0, None, 10.2), s(1, 7, 10.1)], 1),
        ([s(0, None, 10.0), s(1, 3, 10.1)], 0),
        # full tie: the lowest global rank
        ([s(0, 5, 10.0, rank=9), s(1, 5, 10.0, rank=4)], 1),
        # no progress time known sorts last
        ([s(0, None, None), s(1, None, 12.0)], 1),
        ([s(3, 2, 1.0)], 3),
    ],
)
def test_blame_table(stalled: list[Stalled], root: int) -> None:
    order = blame(stalled)
    assert order[0].local_rank == root
    assert sorted(x.local_rank for x in order) == sorted(x.local_rank for x in stalled)


# Ties: beats without iterations (examples/train_ddp.py). The sleeping rank and the rank
# blocked on it both beat last at the end of the same step, within a few ms, in no
# meaningful order; BLAME_RESOLUTION (10 ms) says how close is a tie.
@pytest.mark.parametrize(
    ("stalled", "root"),
    [
        # beats 0.4 ms apart, the waiter's older: a tie, so not a coin toss on the beat;
        # the waiter opened a section (went on to its collective) after it, the sleeper
        # did nothing since: the sleeper stopped first
        ([s(0, None, 10.0, active=10.05), s(1, None, 10.0004, active=10.0004)], 1),
        ([s(0, None, 10.0004, active=10.0004), s(1, None, 10.0, active=10.05)], 0),
        # the waiter opened its section 10 us after its beat: still more than the sleeper
        ([s(0, None, 10.0, active=10.00001), s(1, None, 10.0004, active=10.0004)], 1),
        # both did something since their beat: the oldest last sign of life, when it is
        # older by more than the resolution (the sleeper left its last section earlier)
        ([s(0, None, 10.0, active=10.02), s(1, None, 10.001, active=10.008)], 1),
        # a stopped process (SIGSTOP) cannot be the one blocked in a collective
        ([s(0, None, 10.0), s(1, None, 10.003, stopped=True)], 1),
        ([s(0, None, 10.0, active=10.0, stopped=True), s(1, None, 10.003, active=10.003)], 0),
        # stopped beats activity: the order of the rules
        ([s(0, None, 10.0, active=10.0), s(1, None, 10.002, active=10.5, stopped=True)], 1),
        # beats further apart than the resolution: the older one, whatever follows
        ([s(0, None, 10.0), s(1, None, 10.5, stopped=True)], 0),
        ([s(0, None, 10.0, active=10.9), s(1, None, 10.02, active=10.02)], 0),
        # nothing tells them apart: the lowest global rank, not the slightly older beat
        ([s(0, None, 10.0, rank=5), s(1, None, 10.001, rank=2)], 1),
        ([s(0, None, 10.0, rank=5, active=10.3), s(1, None, 10.001, rank=2, active=10.305)], 1),
        # an unknown activity time never wins over a known one
        ([s(0, None, 10.0, rank=0), s(1, None, 10.001, rank=1, active=10.001)], 1),
        # iterations still come first: a tie on beats only among the lowest iteration
        ([s(0, 4, 10.0, active=10.0), s(1, 5, 10.001, active=10.001, stopped=True)], 0),
        # three ranks, two of them tied with the oldest beat
        ([s(0, None, 10.004, active=10.3), s(1, None, 10.0, active=10.2), s(2, None, 10.5)], 1),
    ],
)
def test_blame_ties(stalled: list[Stalled], root: int) -> None:
    order = blame(stalled)
    assert order[0].local_rank == root
    assert sorted(x.local_rank for x in order) == sorted(x.local_rank for x in stalled)


def test_blame_resolution_zero_is_strict_age() -> None:
    ranks = [s(0, None, 10.0, active=10.05), s(1, None, 10.0004, active=10.0004)]
    assert blame(ranks, resolution=0.0)[0].local_rank == 0
    assert blame(ranks)[0].local_rank == 1
    assert blame([]) == []


@pytest.mark.parametrize(
    ("fields", "active"),
    [
        ({"last_hb": 110.0}, 110.0),
        # a section opened after the last beat
        ({"last_hb": 110.0, "name_count": 1, "open_times": opened(0, 110.2)}, 110.2),
        # left its last section after the beat
        ({"last_hb": 110.0, "oos_start": 110.3}, 110.3),
        # no beat yet: attach
        ({}, 100.0),
        # an open time from the future (a scribbled slot) is not believed
        ({"last_hb": 110.0, "name_count": 1, "open_times": opened(0, 900.0)}, 110.0),
        # a section index beyond name_count is not read
        ({"last_hb": 110.0, "open_times": opened(3, 110.5)}, 110.0),
    ],
)
def test_verdict_last_active(fields: dict[str, object], active: float) -> None:
    cfg = MonitorConfig(hb_timeout=2, hb_initial_timeout=2)
    v = judge(slot(**fields), ["s0"], cfg, 120.0)
    assert v is not None and v.last_active == active


def _hang(pid: int, rank: int, waiting_on: int | None, at: float) -> HangReport:
    return HangReport(0, rank, pid, HangKind.HEARTBEAT, None, 2.0, 2.1, 5, "", at, waiting_on)


def test_summary_names_the_rank_waited_on() -> None:
    # The waiter was detected (and exited) first; the summary must still name rank 1.
    waiter = WorkerFailed(node_rank=0, local_rank=0, pid=100, exitcode=-15, rank=0, timestamp=50.0)
    sleeper = WorkerFailed(node_rank=0, local_rank=1, pid=101, exitcode=-15, rank=1, timestamp=50.2)
    hangs = {100: _hang(100, 0, 1, 50.0), 101: _hang(101, 1, None, 50.1)}
    failures = {0: waiter, 1: sleeper}
    assert _blame_first(failures, hangs)
    assert root_cause(list(failures.values())).rank == 1


def sleeping_rank_blamed(harness: Harness, mode: str) -> None:
    """Rank 1 falls asleep at step 8 and rank 0 blocks on it (see worker.py's modes)."""
    from tests.helpers import free_port

    mon = harness.start(fast(hb_timeout=1.0, check_interval=0.1), nranks=2)
    port = str(free_port())
    r0 = harness.spawn(0, mode, "0", port, "8")
    r1 = harness.spawn(1, mode, "1", port, "8")
    mon.begin_attempt(0, {0: r0.pid, 1: r1.pid})
    harness.wait_ready(0, timeout=60)
    reports: list[HangReport] = []

    def sleeper_reported() -> bool:
        reports.extend(mon.poll_hangs())
        return any(r.global_rank == 1 for r in reports)

    wait_for(sleeper_reported, 30, "rank 1's hang")
    # With iterations the sleeper is a step behind; without, their heartbeats are a tie
    # that the waiter's section, opened since, breaks.
    with_iterations = mode == "peer_sleeps"
    (sleeper,) = [r for r in reports if r.global_rank == 1]
    assert sleeper.waiting_on is None
    assert sleeper.iteration == (7 if with_iterations else None)
    for r in reports:
        if r.global_rank == 0:
            assert r.waiting_on == 1 and r.iteration == (8 if with_iterations else None)
            assert r.detected_at >= sleeper.detected_at
    events = [f for e, f in harness.events if e == "hang_detected"]
    assert events[0]["global_rank"] == 1 and events[0]["waiting_on"] is None
    assert all(f["waiting_on"] == 1 for f in events if f["global_rank"] == 0)
    r1.wait(timeout=10)


MODES = ["peer_sleeps", "peer_sleeps_no_iteration"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_sleeping_rank_blamed_not_the_one_blocked_on_it(harness: Harness, mode: str) -> None:
    sleeping_rank_blamed(harness, mode)


@pytest.mark.reliability
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("run", range(10))
def test_sleeping_rank_blamed_in_every_run(harness: Harness, mode: str, run: int) -> None:
    sleeping_rank_blamed(harness, mode)
