"""NVIDIA ``fault_tolerance``'s timeout calculator and records under stalwart (issue 26
item 2): ``stalwart.monitor.timeouts_calc.TimeoutsCalc`` and ``stalwart.monitor.data``
with the calls NVIDIA's code makes, as tables; and one real two-rank job, written the way
NVIDIA's code is (no ``__main__`` guard, nothing of stalwart but the import line), whose
ranks agree on the longest intervals through ``synchronize_all`` while a stranger forges
the job store's learning keys and one rank sends a hostile record."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from stalwart.monitor.data import HeartbeatTimeouts, SectionAction, SectionTimeouts
from stalwart.monitor.learned import Observations
from stalwart.monitor.timeouts_calc import TimeoutsCalc, TimeoutsCalcError
from tests.helpers import stalwart

OPEN, CLOSE, CLOSE_ALL = SectionAction.OPEN, SectionAction.CLOSE, SectionAction.CLOSE_ALL


# -- heartbeats ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("beats", "factor", "current", "expected"),
    [
        # first beat 10 s after start, longest gap 7 s
        ([10, 11, 18, 20], 2.0, None, (20.0, 14.0, True)),
        # configured values are replaced by learned ones
        ([10, 11, 18, 20], 2.0, HeartbeatTimeouts(99, 99, were_calculated=False), (20, 14, True)),
        ([10, 11, 18, 20], 2.0, HeartbeatTimeouts(None, None, False), (20.0, 14.0, True)),
        # learned values are averaged with the new ones
        ([10, 11, 18, 20], 2.0, HeartbeatTimeouts(21, 15, True), (20.5, 14.5, True)),
        ([3, 4], 1.0, None, (3.0, 1.0, True)),
    ],
)
def test_heartbeat_timeouts(
    beats: list[float],
    factor: float,
    current: HeartbeatTimeouts | None,
    expected: tuple[float, float, bool],
) -> None:
    calc = TimeoutsCalc(start_time=0, safety_factor=factor)
    for beat in beats:
        calc.update_on_heartbeat(hb_time=beat)
    assert dataclasses.astuple(calc.get_hb_timeouts(current=current)) == expected


def test_heartbeat_timeouts_need_two_beats_and_a_whole_current_record() -> None:
    calc = TimeoutsCalc(start_time=0)
    calc.update_on_heartbeat(hb_time=1)
    assert calc.can_get_hb_timeouts() is False
    with pytest.raises(TimeoutsCalcError, match="two heartbeats"):
        calc.get_hb_timeouts()
    calc.update_on_heartbeat(hb_time=2)
    assert calc.can_get_hb_timeouts() is True
    with pytest.raises(TimeoutsCalcError, match="calculated but incomplete"):
        calc.get_hb_timeouts(current=HeartbeatTimeouts(None, None, were_calculated=True))


# -- sections -----------------------------------------------------------------------------
# (events, selected, calc_oos, expected section table, expected out-of-section)
SECTION_ROWS: list[Any] = [
    # nested sections; the out-of-section stretch runs from start to the first open
    (
        [("one", OPEN, 10), ("two", OPEN, 13), ("two", CLOSE, 23), ("one", CLOSE, 40)],
        None,
        True,
        {"one": 30.0, "two": 10.0},
        5.0,
    ),
    # a later, longer stretch with nothing open wins; a shorter section does not
    (
        [("one", OPEN, 10), ("one", CLOSE, 40), ("two", OPEN, 100), ("two", CLOSE, 101)],
        None,
        True,
        {"one": 30.0, "two": 1.0},
        60.0,
    ),
    # only the selected sections are learned; the others are None
    ([("one", OPEN, 10), ("one", CLOSE, 20)], ["one"], True, {"one": 10.0, "two": None}, 5.0),
    ([("one", OPEN, 10), ("one", CLOSE, 20)], ["one"], False, {"one": 10.0, "two": None}, None),
    ([], [], False, {"one": None, "two": None}, None),
    # CLOSE_ALL closes every open section at once
    (
        [("one", OPEN, 6), ("two", OPEN, 8), (None, CLOSE_ALL, 10)],
        None,
        True,
        {"one": 4.0, "two": 2.0},
        1.0,
    ),
]


@pytest.mark.parametrize(("events", "selected", "calc_oos", "table", "oos"), SECTION_ROWS)
def test_section_timeouts(
    events: list[tuple[str | None, SectionAction, float]],
    selected: list[str] | None,
    calc_oos: bool,
    table: dict[str, float | None],
    oos: float | None,
) -> None:
    calc = TimeoutsCalc(sections=["one", "two"], start_time=5, safety_factor=1.0)
    for section, action, at in events:
        calc.update_on_section_event(section=section, action=action, event_time=at)
    assert calc.can_get_section_timeouts(selected, calc_out_of_section=calc_oos)
    got = calc.get_section_timeouts(selected_sections=selected, calc_out_of_section=calc_oos)
    chosen = {"one", "two"} if selected is None else set(selected)
    assert (got.section, got.out_of_section) == (table, oos)
    assert got.calculated_sections == chosen
    assert got.is_out_of_section_calculated is calc_oos
    assert got.were_calculated is (chosen == {"one", "two"} and calc_oos)


def test_the_running_out_of_section_stretch_is_counted_when_asked() -> None:
    calc = TimeoutsCalc(sections=["one"], start_time=0, safety_factor=2.0)
    calc.update_on_section_event("one", OPEN, 1)
    calc.update_on_section_event("one", CLOSE, 2)
    calc.maybe_bump_oos_time(curr_time=12)
    assert calc.get_section_timeouts().out_of_section == 20.0
    calc.maybe_bump_oos_time(curr_time=5)  # shorter: no change
    assert calc.get_section_timeouts().out_of_section == 20.0


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([("three", OPEN, 1)], "unknown section 'three'"),
        ([("one", OPEN, 1), ("one", OPEN, 2)], "'one' is already open"),
        ([("one", CLOSE, 1)], "'one' is not open"),
        ([("one", OPEN, 1), ("one", CLOSE, 2), ("one", CLOSE, 3)], "'one' is not open"),
        ([("one", "open", 1)], "unknown section action 'open'"),
    ],
)
def test_events_that_do_not_fit_are_refused(
    events: list[tuple[str, Any, float]], message: str
) -> None:
    calc = TimeoutsCalc(sections=["one", "two"], start_time=0)
    with pytest.raises(TimeoutsCalcError, match=message):
        for section, action, at in events:
            calc.update_on_section_event(section, action, at)


# -- merging into the timeouts in force ----------------------------------------------------
def _st(table: dict[str, float | None], oos: float | None, calc: Any, oos_calc: bool) -> Any:
    return SectionTimeouts(table, oos, calc, oos_calc)


@pytest.mark.parametrize(
    ("new", "current", "expected"),
    [
        # learned replaces configured; the current's other values stay
        (
            _st({"one": 101, "two": 103}, 202, {"one"}, True),
            _st({"one": 111, "two": None}, 222, {}, False),
            _st({"one": 101, "two": None}, 202, {"one"}, True),
        ),
        # nothing learned: the current stays as it is
        (
            _st({"one": 999, "two": 999}, 999, set(), False),
            _st({"one": 101, "two": 102}, 103, {"one", "two"}, True),
            _st({"one": 101, "two": 102}, 103, {"one", "two"}, True),
        ),
        # learned on both sides: averaged
        (
            _st({"one": 101, "two": None}, 9, {"one"}, True),
            _st({"one": 102, "two": 223}, 10, {"one", "two"}, True),
            _st({"one": 101.5, "two": 223}, 9.5, {"one", "two"}, True),
        ),
    ],
)
def test_merging_section_timeouts(
    new: SectionTimeouts, current: SectionTimeouts, expected: SectionTimeouts
) -> None:
    assert TimeoutsCalc._get_merged_section_timeouts(new, current) == expected


def test_records_in_nvidias_shape() -> None:
    record = SectionTimeouts({"a": 1.0, "b": None}, 2.0, {}, False)
    assert record.calculated_sections == frozenset() and not record.are_valid
    assert not record.were_calculated
    record = SectionTimeouts({"a": 1.0}, 2.0, ["a"], True)
    assert record.are_valid and record.were_calculated
    assert HeartbeatTimeouts(None, 3.0, False).are_valid is False


# -- hostile input --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, "10", True, [1]])
def test_a_time_that_is_no_finite_number_is_named(bad: Any) -> None:
    calc = TimeoutsCalc(sections=["one"], start_time=0)
    with pytest.raises(TimeoutsCalcError, match=r"must be a finite number of seconds, got "):
        calc.update_on_section_event("one", OPEN, bad)
    with pytest.raises(TimeoutsCalcError, match=r"hb_time must be a finite number"):
        calc.update_on_heartbeat(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"safety_factor": 0.5}, "safety_factor must be a finite number >= 1, got 0.5"),
        ({"safety_factor": math.nan}, "safety_factor must be a finite number >= 1, got nan"),
        ({"sections": ["a", ""]}, "section names must be non-empty strings, got ''"),
        ({"sections": ["a", "a"]}, r"section names must be unique, got \['a', 'a'\]"),
    ],
)
def test_bad_calculator_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TimeoutsCalc(**kwargs)


@pytest.mark.parametrize("bad", ["one", 5, None])
def test_a_calculated_sections_value_that_is_no_collection_is_named(bad: Any) -> None:
    with pytest.raises(TypeError, match="calculated_sections must be a collection of names"):
        SectionTimeouts({"one": 1.0}, 1.0, bad, True)


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, "5", True, None])
def test_a_peers_interval_that_is_no_finite_duration_is_dropped(bad: Any) -> None:
    # What a peer rank sends through synchronize_all, read back from its JSON.
    raw = json.loads(json.dumps({"hb_initial": bad, "hb": 2.0, "sections": {"a": bad}}))
    obs = Observations.from_json(raw)
    assert (obs.hb_initial, obs.hb, obs.sections) == (None, 2.0, {})


# -- a real job ---------------------------------------------------------------------------
# Written the way NVIDIA's code is: no __main__ guard, stalwart only on the import line.
JOB = """
import json, math, os
import torch.distributed as dist
from torch.distributed import TCPStore
from stalwart.monitor.data import SectionAction
from stalwart.monitor.learned import Observations
from stalwart.monitor.timeouts_calc import TimeoutsCalc, TimeoutsCalcError

try:
    TimeoutsCalc().synchronize_all()
except TimeoutsCalcError as exc:
    print("NO_GROUP", exc, flush=True)
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0:
    # A stranger who reaches the job's store forges the keys learned timeouts once
    # went through: synchronize_all must not read them.
    stranger = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, use_libuv=True)
    for seq in range(1, 4):
        for r in range(2):
            stranger.set(f"stalwart/monitor/learn/{seq}/{r}", json.dumps({"hb": 1e6}))
calc = TimeoutsCalc(sections=["step"], start_time=0, safety_factor=1.0)
if rank == 0:
    calc.update_on_heartbeat(hb_time=4)
    calc.update_on_heartbeat(hb_time=5)
    calc.update_on_section_event("step", SectionAction.OPEN, 7)
    calc.update_on_section_event("step", SectionAction.CLOSE, 9)
else:
    # A hostile peer record: an infinite gap and a huge foreign section table.
    calc._observed = Observations(hb_initial=1.0, hb=math.inf,
                                  sections={f"x{i}": 1e9 for i in range(20000)}, oos=30.0)
dist.barrier()
calc.synchronize_all()
hb = calc.get_hb_timeouts()
sec = calc.get_section_timeouts()
print("RESULT " + json.dumps([rank, hb.initial, hb.subsequent, sec.section, sec.out_of_section]),
      flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_ranks_agree_on_the_longest_intervals(tmp_path: Path) -> None:
    script = tmp_path / "nvidia_style.py"
    script.write_text(JOB)
    proc = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "0", "--rdzv-id", "calc",
        "--log-dir", tmp_path / "logs", script, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count("NO_GROUP synchronize_all needs the default torch.distributed") == 2, out
    results = sorted(
        json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line
    )
    # Rank 0's 4 s first beat beats rank 1's 1 s; rank 1's infinite gap is dropped, its
    # 30 s out-of-section stretch wins, and its foreign sections are not reported.
    expected = [4.0, 1.0, {"step": 2.0}, 30.0]
    assert results == [[0, *expected], [1, *expected]], out
