""" "Back at full speed" (issue 24 item 1): from a fault until the next attempt's step
rate, over a window that spans a checkpoint interval, is within 10 % of the rate before
the fault.  Pure functions over (time, step) samples, tested as tables."""

from __future__ import annotations

import pytest

from stalwart.reporting.goodput import Breakdown, Fault, full_speed_at, window_steps
from stalwart.reporting.summary import format_block


def steady(t0: float, s0: int, s1: int, dt: float) -> list[tuple[float, int]]:
    return [(t0 + (s - s0) * dt, s) for s in range(s0, s1 + 1)]


BEFORE = steady(0.0, 0, 100, 0.1)  # 10 steps/s


@pytest.mark.parametrize(
    ("after", "window", "expected"),
    [
        # Back at speed from its first step: full speed == first step.
        (steady(20.0, 80, 150, 0.1), 10, 20.0),
        # A 1.4 s stall at step 90 (the writer still starting): the windows holding it
        # are slow; speed is back from the first window past it (starting at step 90+).
        (steady(20.0, 80, 90, 0.1) + steady(22.4, 91, 150, 0.1), 10, pytest.approx(22.4)),
        # Slow for good (half speed): never back.
        (steady(20.0, 80, 150, 0.2), 10, None),
        # 5 % slower is within 10 %: back at once.
        (steady(20.0, 80, 150, 0.105), 10, 20.0),
        # Too few samples to judge.
        ([(20.0, 80)], 10, None),
    ],
)
def test_full_speed_at(after: list[tuple[float, int]], window: int, expected: object) -> None:
    assert full_speed_at(BEFORE, after, window) == expected


def test_a_short_attempt_after_the_fault_is_judged_on_what_it_ran() -> None:
    # 5 steps at full rate, fewer than a window: judged on those.
    assert full_speed_at(BEFORE, steady(20.0, 80, 85, 0.1), 10) == 20.0


def test_the_failed_attempts_warm_up_is_not_its_rate() -> None:
    # The first window of the failed attempt was slow (start-up): its steady rate counts.
    before = steady(0.0, 0, 10, 0.5) + steady(5.1, 11, 100, 0.1)
    assert full_speed_at(before, steady(30.0, 90, 150, 0.1), 10) == 30.0


@pytest.mark.parametrize(
    ("steps", "expected"),
    [([], 10), ([20], 10), ([20, 40, 60, 80], 20), ([5, 10, 10, 15, 100], 5), ([7, 7], 10)],
)
def test_window_steps(steps: list[int], expected: int) -> None:
    assert window_steps(steps) == expected


def test_the_closing_block_shows_both_beside_the_cost() -> None:
    fault = Fault(0, "crash", 1, "signal SIGSEGV", 10.0, cost=1.5, first_step_s=0.4)
    fault.full_speed_s = 1.9
    b = Breakdown(0.0, 30.0, {"productive": 25.0}, [], [fault], True)
    b.seconds.update(dict.fromkeys(("startup", "detection", "teardown", "restart"), 0.0))
    b.seconds.update(recompute=0.0, checkpoint_stall=0.0, idle=0.0)
    text = format_block(b, run_id="r", outcome="succeeded", attempts=2, run_dir=None)
    assert "first step after 0.4 s, full speed after 1.9 s" in text
    fault.full_speed_s = None
    text = format_block(b, run_id="r", outcome="succeeded", attempts=2, run_dir=None)
    assert "full speed after not reached" in text
