"""NodeMonitor against real worker processes: each kind of hang is detected and reaped."""

from __future__ import annotations

import signal
import time

import pytest

from stalwart.monitor import HangKind, MonitorConfig

from .conftest import Harness, wait_for

FAST = dict(check_interval=0.05, stack_dump_wait=0.3, term_grace=1.0)


def _one_hang(h: Harness, timeout: float) -> object:
    assert h.monitor is not None
    found: list[object] = []

    def poll() -> bool:
        found.extend(h.monitor.poll_hangs())  # type: ignore[union-attr]
        return bool(found)

    wait_for(poll, timeout, "a hang report")
    assert len(found) == 1
    return found[0]


@pytest.mark.timeout(60)
def test_heartbeat_timeout_detected_with_stacks(harness: Harness) -> None:
    mon = harness.start(MonitorConfig(hb_timeout=1.0, **FAST))
    proc = harness.spawn(0, "stop_heartbeat")
    mon.begin_attempt(0, {0: proc.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0)
    t0 = time.monotonic()
    report = _one_hang(harness, 10)
    assert report.kind is HangKind.HEARTBEAT  # type: ignore[attr-defined]
    assert report.pid == proc.pid  # type: ignore[attr-defined]
    assert report.iteration == 2  # type: ignore[attr-defined]
    assert report.last_heartbeat_age is not None and report.last_heartbeat_age >= 1.0  # type: ignore[attr-defined]
    assert "time.sleep" in report.stacks or "worker.py" in report.stacks  # type: ignore[attr-defined]
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert time.monotonic() - t0 < 3
    assert "hang_detected" in harness.event_names()
    fields = dict(harness.events)["hang_detected"]
    assert fields["kind"] == "heartbeat" and fields["local_rank"] == 0
    mon.end_attempt()
