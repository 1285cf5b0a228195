"""The verdict rules on synthetic slots."""

from __future__ import annotations

import dataclasses
import math

import pytest

from stalwart.monitor import HangKind, MonitorConfig
from stalwart.monitor.judge import (
    LOOK_SHARE,
    judge,
    judged_early,
    lookout,
    next_deadline,
    problems,
)
from stalwart.monitor.layout import MAX_SECTIONS, SlotSnapshot, SlotState

ZERO = (0.0,) * MAX_SECTIONS


def slot(**kw: object) -> SlotSnapshot:
    base = SlotSnapshot(
        pid=10, beats=0, state=SlotState.ATTACHED, attach_time=100.0, last_hb=0.0,
        iteration=-1, oos_start=100.0, hb_initial_override=0.0, hb_override=0.0,
        oos_override=0.0, last_section=-1, name_count=0, open_times=ZERO, limits=ZERO,
    )  # fmt: skip
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def opened(idx: int, t: float) -> tuple[float, ...]:
    return tuple(t if i == idx else 0.0 for i in range(MAX_SECTIONS))


def test_initial_then_subsequent_heartbeat() -> None:
    cfg = MonitorConfig(hb_timeout=2, hb_initial_timeout=10)
    assert judge(slot(), [], cfg, 109) is None
    v = judge(slot(), [], cfg, 111)
    assert v is not None and v.kind is HangKind.INITIAL_HEARTBEAT and v.timeout == 10
    assert judge(slot(last_hb=110.0), [], cfg, 111.9) is None
    v = judge(slot(last_hb=110.0, iteration=5), [], cfg, 112.5)
    assert v is not None and v.kind is HangKind.HEARTBEAT and v.iteration == 5
    assert v.last_heartbeat_age == 2.5


def test_learned_override_wins_and_inf_disables() -> None:
    cfg = MonitorConfig(hb_timeout=2)
    assert judge(slot(last_hb=110.0, hb_override=5.0), [], cfg, 114) is None
    assert judge(slot(last_hb=110.0, hb_override=math.inf), [], cfg, 1e6) is None
    v = judge(slot(last_hb=110.0, hb_override=1.0), [], MonitorConfig(), 111.5)
    assert v is not None and v.timeout == 1.0


def test_open_section_suspends_out_of_section() -> None:
    cfg = MonitorConfig(section_timeouts={"fwd": 3}, out_of_section_timeout=1)
    names = ["io", "fwd"]
    # "io" has no timeout: it may run for ever, and while it is open OOS is not judged.
    assert judge(slot(name_count=2, open_times=opened(0, 100.0)), names, cfg, 500) is None
    v = judge(slot(name_count=2, open_times=opened(1, 100.0)), names, cfg, 103.5)
    assert v is not None and v.kind is HangKind.SECTION and v.section == "fwd"
    v = judge(slot(name_count=2, oos_start=200.0, last_section=1), names, cfg, 201.5)
    assert v is not None and v.kind is HangKind.OUT_OF_SECTION and v.section == "fwd"
    lim = tuple(0.5 if i == 1 else 0.0 for i in range(MAX_SECTIONS))
    v = judge(slot(name_count=2, open_times=opened(1, 100.0), limits=lim), names, cfg, 100.6)
    assert v is not None and v.timeout == 0.5


def test_detached_or_free_slots_are_never_judged() -> None:
    cfg = MonitorConfig(hb_timeout=1, hb_initial_timeout=1)
    assert judge(slot(state=SlotState.DETACHED), [], cfg, 1e9) is None
    assert judge(slot(pid=0), [], cfg, 1e9) is None


# Numbers no healthy rank writes: each must be ignored, never believed (issue 10 item 7).
BAD = [-1.0, -math.inf, math.nan, 5e-324, -5e-324, 1e-9, 1e300]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("field", ["hb_override", "hb_initial_override", "oos_override"])
def test_out_of_range_override_falls_back_to_the_config(field: str, value: float) -> None:
    cfg = MonitorConfig(hb_timeout=2, hb_initial_timeout=10, out_of_section_timeout=5)
    hb = 0.0 if field == "hb_initial_override" else 110.0
    snap = slot(last_hb=hb, attach_time=105.0, oos_start=110.0, **{field: value})
    assert judge(snap, [], cfg, 111.0, floor=50.0) is None  # within every configured limit
    assert field.removesuffix("_override") in problems(snap, 50.0, 111.0)


@pytest.mark.parametrize("value", [*BAD, 10.0, 500.0])  # 10: before the segment existed
@pytest.mark.parametrize("field", ["last_hb", "attach_time", "oos_start"])
def test_unbelievable_timestamp_skips_its_check(field: str, value: float) -> None:
    cfg = MonitorConfig(hb_timeout=2, hb_initial_timeout=10, out_of_section_timeout=5)
    snap = slot(**{"last_hb": 110.0, "attach_time": 105.0, "oos_start": 110.0, field: value})
    assert judge(snap, [], cfg, 111.0, floor=50.0) is None
    assert field in problems(snap, 50.0, 111.0)


@pytest.mark.parametrize("value", BAD)
def test_bad_section_numbers(value: float) -> None:
    cfg = MonitorConfig(section_timeouts={"fwd": 3}, out_of_section_timeout=1)
    lim = tuple(value if i == 0 else 0.0 for i in range(MAX_SECTIONS))
    snap = slot(name_count=1, open_times=opened(0, 110.0), limits=lim, oos_start=60.0)
    assert judge(snap, ["fwd"], cfg, 111.0, floor=50.0) is None
    snap = slot(name_count=1, open_times=opened(0, value), oos_start=60.0)
    # An open section, however odd its time, still stops the out-of-section clock.
    assert judge(snap, ["fwd"], cfg, 111.0, floor=50.0) is None
    assert "open[0]" in problems(snap, 50.0, 111.0)


def test_in_range_values_are_believed() -> None:
    cfg = MonitorConfig(hb_timeout=2)
    snap = slot(last_hb=60.0, hb_override=math.inf)
    assert judge(snap, [], cfg, 111.0, floor=50.0) is None and problems(snap, 50.0, 111.0) == []
    v = judge(slot(last_hb=60.0, hb_override=0.5), [], cfg, 111.0, floor=50.0)
    assert v is not None and v.timeout == 0.5


@pytest.mark.parametrize(
    ("snap", "names", "cfg", "due"),
    [
        (slot(), [], MonitorConfig(hb_timeout=2, hb_initial_timeout=10), 110.0),
        (slot(last_hb=110.0), [], MonitorConfig(hb_timeout=2), 112.0),
        (slot(last_hb=110.0, hb_override=0.5), [], MonitorConfig(hb_timeout=2), 110.5),
        (slot(last_hb=110.0, hb_override=math.inf), [], MonitorConfig(hb_timeout=2), None),
        (slot(last_hb=110.0), [], MonitorConfig(), None),
        (
            slot(last_hb=110.0, name_count=2, open_times=opened(1, 110.5)),
            ["io", "fwd"],
            MonitorConfig(hb_timeout=5, section_timeouts={"fwd": 1}, out_of_section_timeout=0.1),
            111.5,  # the section's; out-of-section is not judged while one is open
        ),
        (
            slot(last_hb=110.0, name_count=1, oos_start=110.2),
            ["fwd"],
            MonitorConfig(hb_timeout=5, out_of_section_timeout=0.3),
            110.5,
        ),
        (slot(pid=0), [], MonitorConfig(hb_timeout=2), None),
    ],
)
def test_next_deadline_is_when_judge_first_finds_a_hang(
    snap: SlotSnapshot, names: list[str], cfg: MonitorConfig, due: float | None
) -> None:
    got = next_deadline(snap, names, cfg, 110.0, floor=1.0)
    assert got == (pytest.approx(due) if due is not None else None)
    if due is not None:
        assert judge(snap, names, cfg, due - 1e-6, floor=1.0) is None
        assert judge(snap, names, cfg, due + 1e-6, floor=1.0) is not None


@pytest.mark.parametrize(
    ("snap", "cfg", "lead", "look"),
    [
        # A learned 0.6 s deadline: the first look a window (0.3 s) before it.
        (slot(last_hb=110.0), MonitorConfig(hb_timeout=0.6), 0.3, (110.0, 110.3, 110.6)),
        (slot(last_hb=110.0), MonitorConfig(hb_timeout=5), 0.3, (110.0, 114.7, 115.0)),
        # Shorter than two windows: never before half of it (a rank that just stepped
        # is not late by its rhythm).
        (slot(last_hb=110.0), MonitorConfig(hb_timeout=0.4), 0.3, (110.0, 110.2, 110.4)),
        (slot(last_hb=110.0), MonitorConfig(hb_timeout=0.1), 0.3, (110.0, 110.05, 110.1)),
        # Before the first heartbeat: the initial clock, from attach.
        (slot(), MonitorConfig(hb_timeout=2, hb_initial_timeout=10), 0.3, (100.0, 109.7, 110.0)),
        # The earliest of several clocks decides.
        (
            slot(last_hb=110.0, name_count=1, oos_start=110.2),
            MonitorConfig(hb_timeout=5, out_of_section_timeout=0.8),
            0.3,
            (110.2, 110.7, 111.0),
        ),
        (slot(last_hb=110.0), MonitorConfig(), 0.3, None),  # no deadline runs
        # Hostile slot values (any process of the job can write its slot): a timestamp
        # nobody could have written honestly runs no clock, a bad override is ignored.
        (slot(last_hb=1e300), MonitorConfig(hb_timeout=0.6), 0.3, None),
        (slot(last_hb=math.nan), MonitorConfig(hb_timeout=0.6), 0.3, None),
        (slot(last_hb=-math.inf), MonitorConfig(hb_timeout=0.6), 0.3, None),
        (
            slot(last_hb=110.0, hb_override=-5.0),
            MonitorConfig(hb_timeout=0.6),
            0.3,
            (110.0, 110.3, 110.6),
        ),
        (
            slot(last_hb=110.0, hb_override=1e-300),
            MonitorConfig(hb_timeout=2),
            0.3,
            (110.0, 111.7, 112.0),
        ),
        (slot(pid=0), MonitorConfig(hb_timeout=2), 0.3, None),
        (slot(last_hb=110.0), MonitorConfig(hb_timeout=2), -1.0, (110.0, 112.0, 112.0)),
    ],
)
def test_lookout_is_a_window_before_the_deadline_once_late(
    snap: SlotSnapshot, cfg: MonitorConfig, lead: float, look: tuple[float, float, float] | None
) -> None:
    got = lookout(snap, ["fwd"], cfg, 110.0, floor=1.0, lead=lead)
    if look is None:
        assert got is None
        return
    assert got is not None
    assert (got.since, got.look, got.due) == pytest.approx(look)
    assert got.due == pytest.approx(next_deadline(snap, ["fwd"], cfg, 110.0, floor=1.0))
    assert got.look - got.since >= LOOK_SHARE * (got.due - got.since) - 1e-9


@pytest.mark.parametrize(
    ("snap", "cfg", "now", "want"),
    [
        # Not yet past its 0.6 s deadline: its heartbeat clock, with its real age.
        (slot(last_hb=110.0, iteration=40), MonitorConfig(hb_timeout=0.6), 110.4, (0.6, 0.4)),
        # Past it: exactly judge's verdict.
        (slot(last_hb=110.0, iteration=40), MonitorConfig(hb_timeout=0.6), 110.7, (0.6, 0.7)),
        # The nearest of several deadlines names the kind (here the section's).
        (
            slot(last_hb=110.0, name_count=1, open_times=opened(0, 110.1), limits=opened(0, 0.3)),
            MonitorConfig(hb_timeout=5),
            110.2,
            (0.3, 0.2),
        ),
        (slot(last_hb=110.0), MonitorConfig(), 110.4, None),  # no deadline runs
        (slot(last_hb=1e300), MonitorConfig(hb_timeout=0.6), 110.4, None),  # forged time
        (slot(pid=0, last_hb=110.0), MonitorConfig(hb_timeout=0.6), 110.4, None),
    ],
)
def test_judged_early_reads_the_nearest_deadline(
    snap: SlotSnapshot, cfg: MonitorConfig, now: float, want: tuple[float, float] | None
) -> None:
    got = judged_early(snap, ["fwd"], cfg, now, floor=1.0)
    if want is None:
        assert got is None
        return
    assert got is not None and got.stalled_since == 110.0
    assert (got.timeout, got.last_heartbeat_age) == pytest.approx(want)
    past = judge(snap, ["fwd"], cfg, now, floor=1.0)
    assert past is None or past == got
