"""Stragglers: a rank slower per step than the node's others is named (information only)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from stalwart.monitor.judge import stragglers
from tests.helpers import wait_for

from .conftest import Harness
from .test_hangs import fast


@pytest.mark.parametrize(
    ("step_times", "factor", "expected"),
    [
        ({0: 0.1, 1: 0.1, 2: 0.3}, 2.0, {2: pytest.approx(3.0)}),
        ({0: 0.1, 1: 0.1, 2: 0.15}, 2.0, {}),
        ({0: 0.1, 1: 0.25}, 2.0, {1: pytest.approx(2.5)}),  # one of two is still named
        ({0: 0.1}, 2.0, {}),  # nobody to compare with
        ({}, 2.0, {}),
        # the median of the others: one slow rank does not raise its own bar
        ({0: 0.1, 1: 0.1, 2: 0.1, 3: 1.0}, 5.0, {3: pytest.approx(10.0)}),
        ({0: 0.0, 1: 0.1}, 2.0, {}),  # a zero median is no baseline
    ],
)
def test_straggler_table(step_times: dict[int, float], factor: float, expected: Any) -> None:
    assert stragglers(step_times, factor) == expected


def straggler_events(h: Harness) -> list[dict[str, Any]]:
    return [f for e, f in h.events if e == "straggler"]


@pytest.mark.timeout(60)
def test_slow_rank_is_named_and_not_killed(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stalwart.monitor.node_stragglers")
    mon = harness.start(fast(hb_timeout=30.0, straggler_window=1.0), nranks=3)
    procs = [
        harness.spawn(r, "rhythm", "100000", "0.06" if r == 2 else "0.02", "0", "1", "-1")
        for r in range(3)
    ]
    mon.begin_attempt(0, {r: p.pid for r, p in enumerate(procs)})
    wait_for(lambda: len(straggler_events(harness)) >= 2, 20, "two straggler verdicts")
    events = straggler_events(harness)
    assert {e["global_rank"] for e in events} == {2}
    assert all(2.0 <= e["ratio"] <= 5.0 for e in events), events
    assert events[0]["host"] and events[0]["local_rank"] == 2
    assert all(p.poll() is None for p in procs)  # information, not a restart
    assert mon.poll_hangs() == []
    lines = [r for r in caplog.records if "straggler" in r.getMessage()]
    assert len(lines) == 1  # the console line is rate-limited


@pytest.mark.timeout(60)
def test_healthy_ranks_report_no_straggler(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=30.0, straggler_window=1.0), nranks=3)
    procs = [harness.spawn(r, "rhythm", "150", "0.02", "0", "1", "-1") for r in range(3)]
    mon.begin_attempt(0, {r: p.pid for r, p in enumerate(procs)})
    for p in procs:
        assert p.wait(timeout=40) == 0
    assert straggler_events(harness) == []
