"""Heartbeat-counter liveness as a table: readings at given times -> who is lost."""

from __future__ import annotations

import pytest

from stalwart.base.liveness import CounterWatch

# (name, blind_after, readings as (time, key, value), asked at, key, expected seconds lost or None)
CASES: list[tuple[str, float | None, list[tuple[float, str, object]], float, str, float | None]] = [
    ("never seen", None, [], 100.0, "a", None),
    ("moving counter is alive", None, [(0, "a", 1), (5, "a", 2), (9, "a", 3)], 14.0, "a", None),
    ("still counter within the limit", None, [(0, "a", 1), (5, "a", 1)], 10.0, "a", None),
    ("still counter past the limit", None, [(0, "a", 1), (5, "a", 1)], 10.5, "a", 10.5),
    ("only changes count, not reads", None, [(0, "a", 1), (9, "a", 1)], 11.0, "a", 11.0),
    ("a counter can go down: still a change", None, [(0, "a", 5), (9, "a", 1)], 11.0, "a", None),
    ("each key on its own", None, [(0, "a", 1), (0, "b", 1), (9, "b", 2)], 11.0, "b", None),
    ("vanished key is lost at once", None, [(0, "a", 1), (1, "a", None)], 1.5, "a", 0.5),
    ("vanished key, asked at the same instant", None, [(1, "a", None)], 1.0, "a", None),
    # The observer looked at 0 and then not until 20: the silence in between is forgiven.
    ("blind observer starts afresh", 5.0, [(0, "a", 1), (20, "a", 1)], 25.0, "a", None),
    (
        "blind observer, later silence counts",
        5.0,
        [(0, "a", 1), (20, "a", 1), (24, "a", 1)],
        31.0,
        "a",
        11.0,
    ),
    (
        "watching observer keeps the age",
        5.0,
        [(0, "a", 1), (4, "a", 1), (8, "a", 1)],
        11.0,
        "a",
        11.0,
    ),
]


@pytest.mark.parametrize(
    ("blind_after", "readings", "at", "key", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_lost(
    blind_after: float | None,
    readings: list[tuple[float, str, object]],
    at: float,
    key: str,
    expected: float | None,
) -> None:
    watch = CounterWatch[str](10.0, blind_after=blind_after, now=0.0)
    for t, k, v in readings:
        watch.observe(k, v, now=t)
    assert watch.lost(key, now=at) == expected


def test_one_look_reads_many() -> None:
    watch = CounterWatch[int](1.0, blind_after=0.5, now=0.0)
    watch.observe_many([(0, 1), (1, 1)], now=0.0)
    watch.observe_many([(0, 2), (1, 1)], now=0.4)
    assert watch.lost(0, now=1.3) is None
    assert watch.lost(1, now=1.3) == 1.3


def test_stale_is_observe_then_lost() -> None:
    watch = CounterWatch[int](2.0, now=0.0)
    assert not watch.stale(3, 7, now=0.0)
    assert not watch.stale(3, 7, now=2.0)
    assert watch.stale(3, 7, now=2.5)
    assert not watch.stale(3, 8, now=2.6)
