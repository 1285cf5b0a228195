"""RankMonitorClient in-process: misuse errors, no-op mode, what lands in the slot."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from stalwart.monitor import RankMonitorClient, RankMonitorError, envvars, layout


@pytest.fixture
def seg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    mm = layout.create_segment(tmp_path / "seg", 1)
    monkeypatch.setenv(envvars.SHM_FILE, str(tmp_path / "seg"))
    monkeypatch.setenv(envvars.SLOT, "0")
    return mm


def _client() -> RankMonitorClient:
    c = RankMonitorClient(install_stack_dump=False)
    c.init_workload_monitoring()
    return c


def test_calls_before_init_are_clear_errors() -> None:
    c = RankMonitorClient()
    for call in (c.send_heartbeat, lambda: c.start_section("a"), lambda: c.report_iteration(1)):
        with pytest.raises(RankMonitorError, match="init_workload_monitoring"):
            call()


def test_sections_nest_and_overlap_but_not_twice(seg: object) -> None:
    c = _client()
    c.start_section("a")
    c.start_section("b")
    c.end_section("a")  # overlapping, not nested: allowed
    with pytest.raises(RankMonitorError, match="'b' is already open"):
        c.start_section("b")
    with pytest.raises(RankMonitorError, match="'a' is not open"):
        c.end_section("a")
    with pytest.raises(RankMonitorError, match="'zz' is not open"):
        c.end_section("zz")
    snap = layout.read_slot(seg, 0)  # type: ignore[arg-type]
    names = layout.read_names(seg, 0, snap.name_count)  # type: ignore[arg-type]
    assert names == ["a", "b"]
    assert snap.open_times[0] == 0 and snap.open_times[1] > 0 and snap.last_section == 1
    c.end_all_sections()
    assert layout.read_slot(seg, 0).open_times[1] == 0  # type: ignore[arg-type]
    c.shutdown_workload_monitoring()
    assert layout.read_slot(seg, 0).state == layout.SlotState.DETACHED  # type: ignore[arg-type]


def test_heartbeat_and_iteration_land_in_the_slot(seg: object) -> None:
    c = _client()
    assert c.active
    c.send_heartbeat()
    c.report_iteration(17)
    snap = layout.read_slot(seg, 0)  # type: ignore[arg-type]
    assert snap.last_hb > 0 and snap.iteration == 17 and snap.state == layout.SlotState.ATTACHED
    with pytest.raises(RankMonitorError, match="already called"):
        c.init_workload_monitoring()
    c.shutdown_workload_monitoring()


def test_name_limits(seg: object) -> None:
    c = _client()
    with pytest.raises(RankMonitorError, match="longer than 48"):
        c.start_section("x" * 49)
    c.register_sections([f"s{i}" for i in range(layout.MAX_SECTIONS)])
    with pytest.raises(RankMonitorError, match="too many section names"):
        c.start_section("one-more")
    c.shutdown_workload_monitoring()


def test_without_a_launcher_it_warns_and_does_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(envvars.SHM_FILE, raising=False)
    monkeypatch.delenv(envvars.TIMER_FILE, raising=False)
    with caplog.at_level(logging.WARNING):
        c = _client()
    assert not c.active and "not monitored" in caplog.text
    c.send_heartbeat()
    with c.section("a"):
        pass
    with pytest.raises(RankMonitorError, match="need a stalwart launcher"):
        c.send_workload_control_request("shutdown_workload")
    with pytest.raises(RankMonitorError, match="STALWART_MONITOR_SHM is not set"):
        RankMonitorClient(strict=True).init_workload_monitoring()


def test_bad_slot_env_is_a_clear_error(seg: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envvars.SLOT, "3")
    with pytest.raises(layout.LayoutError, match="outside the segment's 1 slots"):
        RankMonitorClient().init_workload_monitoring()


def test_exception_hook_ends_sections_and_chains(
    seg: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda t, e, tb: seen.append(str(e)))
    c = RankMonitorClient(install_stack_dump=False, install_exception_hook=True)
    c.init_workload_monitoring()
    c.start_section("fwd")
    try:
        raise KeyError("boom")
    except KeyError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    assert seen == ["'boom'"] and c.last_exception == "KeyError: 'boom'"
    assert layout.read_slot(seg, 0).open_times[0] == 0  # type: ignore[arg-type]
    c.shutdown_workload_monitoring()


def test_learned_timeouts_reach_the_slot_as_the_monitor_accepts_them(seg: object) -> None:
    from stalwart.monitor.judge import override_ok

    c = _client()
    c.load_state_dict(
        {"stalwart_monitor": {"version": 1, "heartbeat": {"initial": 2e-5, "subsequent": 1e-5},
                              "sections": {"tiny": 5e-5}, "out_of_section": 3.0}}
    )  # fmt: skip
    snap = layout.read_slot(seg, 0)  # type: ignore[arg-type]
    assert (snap.hb_initial_override, snap.hb_override, snap.oos_override) == (2e-5, 1e-5, 3.0)
    assert snap.limits[0] == 5e-5
    assert all(override_ok(v) for v in (snap.hb_override, snap.oos_override, *snap.limits))
    with pytest.raises(RankMonitorError, match="must be a finite number > 0 of seconds, got 'nan'"):
        c.load_state_dict(
            {"stalwart_monitor": {"version": 1, "heartbeat": {"subsequent": float("nan")}}}
        )
