"""The right rank blamed: when several ranks of a node hang, the one whose progress
stopped first is the root cause and the others are reported as waiting on it."""

from __future__ import annotations

import pytest

from stalwart.launch.errors import ProcessFailure, root_cause
from stalwart.launch.hangs import _blame_first
from stalwart.monitor import HangKind, HangReport
from stalwart.monitor.judge import Stalled, blame
from tests.helpers import wait_for

from .conftest import Harness
from .test_hangs import fast


def s(local: int, iteration: int | None, since: float | None, rank: int | None = None) -> Stalled:
    return Stalled(local, local if rank is None else rank, iteration, since)


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


def _hang(pid: int, rank: int, waiting_on: int | None, at: float) -> HangReport:
    return HangReport(0, rank, pid, HangKind.HEARTBEAT, None, 2.0, 2.1, 5, "", at, waiting_on)


def test_summary_names_the_rank_waited_on() -> None:
    # The waiter was detected (and exited) first; the summary must still name rank 1.
    waiter = ProcessFailure(local_rank=0, pid=100, exitcode=-15, rank=0, timestamp=50.0)
    sleeper = ProcessFailure(local_rank=1, pid=101, exitcode=-15, rank=1, timestamp=50.2)
    hangs = {100: _hang(100, 0, 1, 50.0), 101: _hang(101, 1, None, 50.1)}
    _blame_first([waiter, sleeper], hangs)
    assert root_cause([waiter, sleeper]) is sleeper


@pytest.mark.timeout(120)
def test_sleeping_rank_blamed_not_the_one_blocked_on_it(harness: Harness) -> None:
    sleeping_rank_blamed(harness)


@pytest.mark.reliability
@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", range(10))
def test_sleeping_rank_blamed_in_every_run(harness: Harness, run: int) -> None:
    sleeping_rank_blamed(harness)


def sleeping_rank_blamed(harness: Harness) -> None:
    from tests.helpers import free_port

    mon = harness.start(fast(hb_timeout=1.0, check_interval=0.1), nranks=2)
    port = str(free_port())
    r0 = harness.spawn(0, "peer_sleeps", "0", port, "8")
    r1 = harness.spawn(1, "peer_sleeps", "1", port, "8")
    mon.begin_attempt(0, {0: r0.pid, 1: r1.pid})
    harness.wait_ready(0, timeout=60)
    reports: list[HangReport] = []

    def sleeper_reported() -> bool:
        reports.extend(mon.poll_hangs())
        return any(r.global_rank == 1 for r in reports)

    wait_for(sleeper_reported, 30, "rank 1's hang")
    (sleeper,) = [r for r in reports if r.global_rank == 1]
    assert sleeper.waiting_on is None and sleeper.iteration == 7
    for r in reports:
        if r.global_rank == 0:
            assert r.waiting_on == 1 and r.iteration == 8
            assert r.detected_at >= sleeper.detected_at
    events = [f for e, f in harness.events if e == "hang_detected"]
    assert events[0]["global_rank"] == 1 and events[0]["waiting_on"] is None
    assert all(f["waiting_on"] == 1 for f in events if f["global_rank"] == 0)
    r1.wait(timeout=10)
