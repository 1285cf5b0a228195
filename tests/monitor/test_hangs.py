"""NodeMonitor against real worker processes: each kind of hang is detected and reaped."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from stalwart.monitor import HangKind, HangReport, MonitorConfig
from tests.helpers import wait_for

from .conftest import Harness


def fast(**settings: Any) -> MonitorConfig:
    """A config that checks often and gives up on a hung rank quickly."""
    return MonitorConfig(
        **{"check_interval": 0.05, "stack_dump_wait": 0.5, "term_grace": 1.0, **settings}
    )


def _one_hang(h: Harness, timeout: float) -> HangReport:
    mon = h.monitor
    assert mon is not None
    found: list[HangReport] = []

    def poll() -> bool:
        found.extend(mon.poll_hangs())
        return bool(found)

    wait_for(poll, timeout, "a hang report")
    assert len(found) == 1
    return found[0]


@pytest.mark.timeout(60)
def test_heartbeat_timeout_detected_with_stacks(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=1.0))
    proc = harness.spawn(0, "stop_heartbeat")
    mon.begin_attempt(0, {0: proc.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0)
    t0 = time.monotonic()
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.HEARTBEAT
    assert report.pid == proc.pid
    assert report.iteration == 2
    assert report.last_heartbeat_age is not None and report.last_heartbeat_age >= 1.0
    assert "time.sleep" in report.stacks or "worker.py" in report.stacks
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert time.monotonic() - t0 < 3
    assert "hang_detected" in harness.event_names()
    fields = dict(harness.events)["hang_detected"]
    assert fields["kind"] == "heartbeat" and fields["local_rank"] == 0
    mon.end_attempt()


@pytest.mark.timeout(60)
def test_a_hang_never_sets_off_the_programs_own_sigusr1_handler(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=1.0))
    proc = harness.spawn(0, "stop_heartbeat_own_usr1")
    mon.begin_attempt(0, {0: proc.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0)
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.HEARTBEAT
    assert proc.wait(timeout=10) == -signal.SIGTERM
    # The stacks came through the dump's own signal; SIGUSR1 stayed the program's.
    assert "worker.py" in report.stacks
    assert "OWN SIGUSR1 HANDLER" not in harness.stderr_path(0).read_text()
    mon.end_attempt()


@pytest.mark.timeout(60)
def test_initial_heartbeat_timeout(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=1.0, hb_initial_timeout=1.5))
    proc = harness.spawn(0, "no_heartbeat")
    mon.begin_attempt(0, {0: proc.pid})
    report = _one_hang(harness, 20)
    assert report.kind is HangKind.INITIAL_HEARTBEAT
    assert report.timeout == 1.5
    assert report.last_heartbeat_age is None
    proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_section_timeout_names_the_section(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=5.0, section_timeouts={"slow": 1.0, "outer": 30.0}))
    proc = harness.spawn(0, "section_hang")
    mon.begin_attempt(0, {0: proc.pid})
    harness.wait_ready(0)
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.SECTION
    assert report.section == "slow" and report.timeout == 1.0
    proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_out_of_section_timeout(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=5.0, out_of_section_timeout=1.0))
    proc = harness.spawn(0, "oos_hang")
    mon.begin_attempt(0, {0: proc.pid})
    harness.wait_ready(0)
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.OUT_OF_SECTION
    assert report.section == "step"
    proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_sigstopped_rank_dumps_stacks_and_dies(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=1.0))
    proc = harness.spawn(0, "sigstop")
    mon.begin_attempt(0, {0: proc.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0)
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.HEARTBEAT
    assert "worker.py" in report.stacks
    assert proc.wait(timeout=10) != 0


@pytest.mark.timeout(60)
def test_rank_spinning_in_c_with_gil_held(harness: Harness) -> None:
    mon = harness.start(fast(hb_timeout=1.0))
    proc = harness.spawn(0, "gil_spin")
    mon.begin_attempt(0, {0: proc.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0)
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.HEARTBEAT
    assert "worker.py" in report.stacks
    assert proc.wait(timeout=10) == -signal.SIGTERM


@pytest.mark.timeout(60)
def test_term_escalates_to_kill(harness: Harness) -> None:
    # SIGWINCH is ignored by default, so only the SIGKILL that follows can end the worker.
    mon = harness.start(fast(hb_timeout=1.0, term_signal=signal.SIGWINCH, term_grace=0.5))
    proc = harness.spawn(0, "stop_heartbeat")
    mon.begin_attempt(0, {0: proc.pid})
    harness.wait_ready(0)
    _one_hang(harness, 10)
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_no_false_positive_when_healthy_or_torn_down(harness: Harness) -> None:
    config = fast(
        hb_timeout=0.5,
        hb_initial_timeout=20,
        section_timeouts={"step": 0.5},
        out_of_section_timeout=0.5,
    )
    mon = harness.start(config, nranks=2)
    healthy = harness.spawn(0, "healthy", "150", "0.01")
    stuck = harness.spawn(1, "stop_heartbeat")
    mon.begin_attempt(0, {0: healthy.pid, 1: stuck.pid})
    harness.wait_ready(1)
    mon.end_attempt()  # the supervisor is tearing the attempt down: rank 1 is not judged
    mon.begin_attempt(1, {0: healthy.pid})
    assert healthy.wait(timeout=30) == 0
    assert b"DONE" in harness.stdout_path(0).read_bytes()
    # Rank 1's deadline passed long before rank 0 finished: a whole scan from now on
    # is the monitor's chance to judge it.
    assert mon.wait_scanned_since(time.monotonic(), 30), "the monitor stopped scanning"
    assert mon.poll_hangs() == []
    assert "hang_detected" not in harness.event_names()


@pytest.mark.timeout(90)
def test_rank_blocked_in_gloo_collective(harness: Harness) -> None:
    from tests.helpers import free_port

    mon = harness.start(fast(hb_timeout=2.0), nranks=2)
    port = str(free_port())
    r0 = harness.spawn(0, "gloo_block", "0", port)
    r1 = harness.spawn(1, "gloo_block", "1", port)
    mon.begin_attempt(0, {0: r0.pid, 1: r1.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0, timeout=60)
    report = _one_hang(harness, 20)
    assert report.local_rank == 0 and report.kind is HangKind.HEARTBEAT
    assert "all_reduce" in report.stacks, report.stacks
    assert r0.wait(timeout=10) != 0
    assert r1.poll() is None  # the healthy peer is the supervisor's to stop


@pytest.mark.timeout(60)
def test_end_attempt_reports_a_hang_still_waiting_for_stacks(harness: Harness) -> None:
    # No stderr path given: the monitor waits the full stack_dump_wait (10 s) before
    # terminating, unless the supervisor ends the attempt first.
    mon = harness.start(MonitorConfig(hb_timeout=1.0, check_interval=0.05, stack_dump_wait=10))
    proc = harness.spawn(0, "stop_heartbeat")
    mon.begin_attempt(4, {0: proc.pid})
    harness.wait_ready(0)
    wait_for(
        lambda: b"most recent call first" in harness.stderr_path(0).read_bytes(), 10, "stack dump"
    )
    assert mon.poll_hangs() == []
    t0 = time.monotonic()
    mon.end_attempt()
    (report,) = mon.poll_hangs()
    assert report.kind is HangKind.HEARTBEAT and report.pid == proc.pid
    assert proc.wait(timeout=5) == -signal.SIGTERM
    assert time.monotonic() - t0 < 5
    assert dict(harness.events)["hang_detected"]["attempt"] == 4


@pytest.mark.timeout(60)
def test_reattached_client_is_judged_by_its_own_section_names(harness: Harness) -> None:
    mon = harness.start(fast(section_timeouts={"relaxed": 600.0, "strict": 1.0}))
    proc = harness.spawn(0, "reinit_section")
    mon.begin_attempt(0, {0: proc.pid})
    harness.wait_ready(0)
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.SECTION and report.section == "strict"
    proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_scanner_looks_when_the_deadline_passes(harness: Harness) -> None:
    """With a check interval of 1 s and a 1.5 s timeout, the hang is found just after
    its deadline, not up to an interval later (the scanner sleeps until it)."""
    mon = harness.start(fast(hb_timeout=1.5, check_interval=1.0))
    proc = harness.spawn(0, "stop_heartbeat")
    mon.begin_attempt(0, {0: proc.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0)
    report = _one_hang(harness, 20)
    age = report.last_heartbeat_age
    assert age is not None and 1.5 <= age < 1.5 + 0.25, age
    mon.end_attempt()


def test_scanner_wait_follows_the_nearest_deadline() -> None:
    from stalwart.monitor.node import DEADLINE_MIN_WAIT, DEADLINE_SLACK, scan_wait

    now = 0.0  # exact sums: the bounds below are the same float expressions
    # Armed ranks only (one already reported is not among them): one due in 0.2 s, one
    # past (being handled or gone), one with no deadline.
    wait = scan_wait([now + 0.2, now - 1.0, None], now, 0.5)
    assert 0.2 - 0.05 < wait <= 0.2 + DEADLINE_SLACK
    assert scan_wait([now + 5.0, now - 1.0, None], now, 0.5) == 0.5  # never past the interval
    assert scan_wait([], now, 0.5) == 0.5
    # Never more often than DEADLINE_MIN_WAIT; the slack (BLAME_RESOLUTION, so that ranks
    # stale a moment apart are found in one scan) may already be longer.
    wait = scan_wait([now + 1e-4], now, 0.5)
    assert DEADLINE_MIN_WAIT <= wait <= 1e-4 + DEADLINE_SLACK
