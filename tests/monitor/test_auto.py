"""Timeouts learned by the node monitor (`--hb-timeout auto`): rules as tables, then real
worker processes at a steady rhythm with occasional slow steps."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from stalwart.config.hang import monitor_config
from stalwart.monitor import HangKind, HangReport, MonitorConfig, NodeMonitor
from stalwart.monitor.auto import (
    AutoSettings,
    Rhythm,
    from_rhythms,
    learn,
    longest_gap,
    merge,
)
from stalwart.monitor.layout import MAX_SECTIONS, SlotSnapshot, SlotState
from stalwart.monitor.learned import LearnedTimeouts
from tests.helpers import wait_for

from .conftest import Harness


@pytest.mark.parametrize(
    ("samples", "percentile", "factor", "floor", "expected"),
    [
        ([], 100, 5, 0.5, None),
        ([0.1, 0.2, 0.1], 100, 5, 0.5, 1.0),  # the maximum times the factor
        ([0.01, 0.02], 100, 5, 0.5, 0.5),  # never below the floor
        ([0.1] * 99 + [1.0], 99, 2, 0.01, 0.2),  # p99 leaves out the one outlier
        ([0.1] * 99 + [1.0], 100, 2, 0.01, 2.0),
        ([0.3], 50, 3, 0.1, pytest.approx(0.9)),
    ],
)
def test_learn_table(
    samples: list[float], percentile: float, factor: float, floor: float, expected: Any
) -> None:
    assert learn(samples, percentile, factor, floor) == expected


ZERO = (0.0,) * MAX_SECTIONS


def snap(
    last_hb: float = 0.0, opened: dict[int, float] | None = None, oos: float = 0.0, it: int = -1
) -> SlotSnapshot:
    times = tuple((opened or {}).get(i, 0.0) for i in range(MAX_SECTIONS))
    return SlotSnapshot(
        pid=1, beats=0, state=SlotState.ATTACHED, attach_time=1.0, last_hb=last_hb,
        iteration=it, oos_start=oos, hb_initial_override=0.0, hb_override=0.0,
        oos_override=0.0, last_section=-1, name_count=len(opened or {}), open_times=times,
        limits=ZERO,
    )  # fmt: skip


def test_rhythm_observes_gaps_sections_and_out_of_section() -> None:
    r = Rhythm()
    assert not r.observe(snap(last_hb=10.0, oos=9.0, it=0), [], 10.05, relearn=False)
    r.observe(snap(last_hb=10.0, oos=9.0, it=0), [], 10.1, relearn=False)  # same beat: no gap
    r.observe(snap(last_hb=10.3, opened={0: 10.2}, it=2), ["step"], 10.35, relearn=False)
    assert list(r.hb_gaps) == [pytest.approx(0.3)]
    assert list(r.oos) == [pytest.approx(10.35 - 9.0)]  # a section opened: the stretch ended
    # closed before the next read: lasted at most until that read
    r.observe(snap(last_hb=10.5, oos=10.45, it=3), ["step"], 10.5, relearn=False)
    assert list(r.sections["step"]) == [pytest.approx(0.3)]
    # steps: the first beat, then iterations 0 -> 2 (a beat between two reads), 2 -> 3;
    # the name "step" appeared before the rank was warm (relearn=False): no reset
    assert r.beats == 4


def test_new_section_name_sends_the_rank_back_to_warm_up() -> None:
    r = Rhythm()
    for i in range(5):
        r.observe(snap(last_hb=1.0 + i, opened={0: 1.0 + i}), ["step"], 1.0 + i, relearn=True)
    assert r.warm(3, 0.0, 6.0)
    assert r.observe(snap(last_hb=7.0, opened={1: 7.0}), ["step", "eval"], 7.0, relearn=True)
    assert not r.warm(3, 0.0, 7.0) and r.beats == 0
    assert not r.observe(snap(last_hb=8.0, opened={1: 7.0}), ["step", "eval"], 8.0, relearn=True)


def test_from_rhythms_pools_ranks_and_merge_only_grows() -> None:
    s = AutoSettings(True, True, False, 1, 0.0, 100.0, 5.0, 0.01)
    a, b = Rhythm(), Rhythm()
    a.hb_gaps.extend([0.1, 0.1])
    b.hb_gaps.extend([0.3])
    b.sections["ckpt"] = type(b.oos)([0.4])
    learned = from_rhythms([a, b], s)
    assert learned.hb == pytest.approx(1.5) and learned.oos is None
    assert learned.sections == {"ckpt": pytest.approx(2.0)}
    old = LearnedTimeouts(hb=3.0, sections={"fwd": 1.0}, oos=None)
    both = merge(old, learned)
    assert both.hb == 3.0 and both.sections == {"ckpt": pytest.approx(2.0), "fwd": 1.0}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"hb_timeout": "auto"}, {"hb_auto": True, "hb_timeout": None}),
        ({"hb_timeout": "AUTO", "out_of_section_timeout": "auto"}, {"oos_auto": True}),
        ({"section_timeouts": "auto"}, {"section_auto": True, "section_timeouts": {}}),
        (
            {"section_timeouts": ["auto", "ckpt=600"]},
            {"section_auto": True, "section_timeouts": {"ckpt": 600.0}},
        ),
        (
            {"hb_timeout": "auto", "auto_warmup_steps": "5", "auto_floor": "0.2"},
            {"auto_warmup_steps": 5, "auto_floor": 0.2},
        ),
    ],
)
def test_config_auto_values(data: dict[str, Any], expected: dict[str, Any]) -> None:
    cfg = monitor_config(data)
    for key, value in expected.items():
        assert getattr(cfg, key) == value
    assert cfg.enabled


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"hb_timeout": "automatic"}, "hb_timeout must be a number of seconds, got 'automatic'"),
        ({"auto_warmup_steps": "0"}, "auto_warmup_steps must be >= 1, got 0"),
        ({"auto_warmup_steps": "x"}, "auto_warmup_steps must be a whole number, got 'x'"),
        ({"auto_percentile": "101"}, "auto_percentile must be in (0, 100], got 101.0"),
        ({"auto_floor": "-1"}, "auto_floor must be > 0 seconds, got -1.0"),
        ({"hb_auto": "maybe"}, "hb_auto must be true or false, got 'maybe'"),
    ],
)
def test_config_auto_errors(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        monitor_config(data)
    assert str(err.value) == f"hang detection: {message}"


def auto_config(**kw: Any) -> MonitorConfig:
    base: dict[str, Any] = dict(
        hb_auto=True, auto_warmup_steps=10, auto_floor=0.2, check_interval=0.05,
        stack_dump_wait=0.3, term_grace=1.0, hb_initial_timeout=30.0,
    )  # fmt: skip
    base.update(kw)
    return MonitorConfig(**base)


def learned_events(h: Harness) -> list[dict[str, Any]]:
    return [f for e, f in h.events if e == "timeouts_learned"]


@pytest.mark.timeout(90)
def test_healthy_rhythm_with_slow_steps_is_never_killed(harness: Harness) -> None:
    mon = harness.start(auto_config())
    # 20 ms steps, every 20th step 5x slower (a simulated checkpoint), 200 steps
    proc = harness.spawn(0, "rhythm", "200", "0.02", "20", "5", "-1")
    mon.begin_attempt(0, {0: proc.pid})
    assert proc.wait(timeout=60) == 0
    assert b"DONE" in harness.stdout_path(0).read_bytes()
    assert mon.poll_hangs() == []
    assert "hang_detected" not in harness.event_names()
    learned = learned_events(harness)
    assert learned, harness.event_names()
    assert 0.2 <= learned[-1]["heartbeat"]["subsequent"] < 30


@pytest.mark.timeout(90)
def test_hang_after_warm_up_caught_within_learned_timeout(harness: Harness, tmp_path: Path) -> None:
    path = tmp_path / "learned_timeouts.json"
    mon = NodeMonitor(tmp_path / "run", auto_config(), 1, lambda e, f: harness.events.append((e, f)),
                      state_dir=tmp_path)  # fmt: skip
    harness.monitor = mon
    mon.start()
    proc = harness.spawn(0, "rhythm", "10000", "0.02", "0", "1", "60")
    mon.begin_attempt(0, {0: proc.pid})
    found: list[HangReport] = []
    wait_for(lambda: found.extend(mon.poll_hangs()) or found, 60, "the hang")
    (report,) = found
    learned = learned_events(harness)[-1]["heartbeat"]["subsequent"]
    assert report.kind is HangKind.HEARTBEAT and report.iteration == 59
    assert report.timeout == learned < 30  # the learned value, not the initial one
    assert report.last_heartbeat_age is not None
    # within the learned timeout plus one check interval (plus scheduling slack)
    assert report.last_heartbeat_age <= learned + 0.05 + 0.25
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert json.loads(path.read_text())["heartbeat"]["subsequent"] == learned


@pytest.mark.timeout(60)
def test_learned_timeouts_read_back_from_the_run_folder(harness: Harness, tmp_path: Path) -> None:
    path = tmp_path / "learned_timeouts.json"
    path.write_text(json.dumps(LearnedTimeouts(hb=0.75, sections={"ckpt": 9.0}).to_state()))
    mon = NodeMonitor(tmp_path / "run", auto_config(auto_warmup_steps=3), 1,
                      lambda e, f: harness.events.append((e, f)), state_dir=tmp_path)  # fmt: skip
    harness.monitor = mon
    mon.start()
    (back,) = learned_events(harness)
    assert back["source"] == str(path)
    assert back["heartbeat"]["subsequent"] == 0.75 and back["sections"] == {"ckpt": 9.0}
    # A rank that hangs after its warm-up is judged by the value read back (0.75 s):
    # 3 warm-up beats 20 ms apart learn at most 0.2 s (the floor), less than what was kept.
    proc = harness.spawn(0, "rhythm", "10000", "0.02", "0", "1", "8")
    mon.begin_attempt(0, {0: proc.pid})
    found: list[HangReport] = []
    wait_for(lambda: found.extend(mon.poll_hangs()) or found, 30, "the hang")
    assert found[0].timeout == 0.75
    proc.wait(timeout=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "content", ["not json", "[1]", '{"version": 1, "heartbeat": {"subsequent": -1}}', "{}"]
)
def test_bad_learned_file_is_ignored(harness: Harness, tmp_path: Path, content: str) -> None:
    path = tmp_path / "learned_timeouts.json"
    path.write_text(content)
    mon = NodeMonitor(tmp_path / "run", auto_config(), 1,
                      lambda e, f: harness.events.append((e, f)), state_dir=tmp_path)  # fmt: skip
    harness.monitor = mon
    mon.start()
    assert learned_events(harness) == []


def test_auto_config_dataclass_defaults() -> None:
    cfg = MonitorConfig(hb_auto=True)
    # Learned deadlines need evidence by default: before warm-up one only starts the
    # evidence cycle, so it is short; without evidence the 60 s fallback stays.
    assert cfg.effective_initial_timeout == 60.0 and cfg.auto_initial_timeout == 5.0
    assert dataclasses.replace(cfg, evidence=False).auto_initial_timeout == 60.0
    assert dataclasses.replace(cfg, hb_initial_timeout=7.0).auto_initial_timeout == 7.0


def test_first_half_of_warm_up_is_not_learned_from() -> None:
    # A 4 s start-up gap (process start, first checkpoint's set-up) must not set the
    # timeout for the whole run; the steady gaps after it do.
    r = Rhythm(settle=2)
    for t in (1.0, 5.0, 5.1, 5.2, 5.3):
        r.observe(snap(last_hb=t, it=int(t * 10)), [], t, relearn=False)
    assert list(r.hb_gaps) == [pytest.approx(0.1)] * 3


@pytest.mark.parametrize(
    ("total", "beats", "shortest", "expected"),
    [
        (0.3, 1, 0.05, 0.3),  # one gap: exactly what was seen
        (0.3, 0, 0.05, 0.3),  # no count: the whole stretch
        (0.3, 3, None, 0.3),  # no gap seen alone yet: the whole stretch
        (0.12, 2, 0.057, pytest.approx(0.063)),  # two steady steps: one step, not the stretch
        (0.5, 2, 0.05, pytest.approx(0.45)),  # a slow step among fast ones keeps its length
        (0.3, 3, 0.2, pytest.approx(0.1)),  # never below the mean of the gaps
    ],
)
def test_longest_gap_table(total: float, beats: int, shortest: Any, expected: Any) -> None:
    assert longest_gap(total, beats, shortest) == expected


def counted(last_hb: float, beats: int) -> SlotSnapshot:
    return dataclasses.replace(snap(last_hb=last_hb), beats=beats)


def test_steps_shorter_than_the_scan_are_learned_as_steps() -> None:
    """57 ms steps read every ~0.1 s: two beats fall between most reads. The samples are
    about one step (so the learned timeout follows the job), and a slow step among them
    keeps its full length."""
    r = Rhythm()
    t, beats = 1.0, 1
    r.observe(counted(t, beats), [], t, relearn=False)
    for i in range(20):
        # alternately one and two beats between reads, the second at +57 ms
        step = 1 if i % 2 == 0 else 2
        t += 0.057 * step
        beats += step
        r.observe(counted(t, beats), [], t + 0.01, relearn=False)
    assert r.shortest == pytest.approx(0.057)
    assert max(r.hb_gaps) == pytest.approx(0.057)  # not the 0.114 s stretch
    t += 0.057 + 0.3  # a slow step (0.357 s) then a fast one, read together
    r.observe(counted(t, beats + 2), [], t + 0.01, relearn=False)
    assert r.hb_gaps[-1] == pytest.approx(0.3)
