"""Bad input on the pipe and in the shared memory cannot switch hang detection off, and
cannot make the monitor signal anything but a worker of the current attempt (issue 10
items 4, 6, 7; issue 12 item 5)."""

from __future__ import annotations

import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stalwart.monitor import (
    ControlAction,
    MonitorConfig,
    NodeMonitor,
    TimerClient,
    layout,
    node,
    node_requests,
)
from stalwart.monitor import timer as timer_mod
from stalwart.monitor.timer_server import ExpiredTimer, TimerServer
from stalwart.monitor.wire import PIPE_BUF, ControlMessage, TimerMessage, encode
from tests.helpers import wait_for

from .conftest import Harness

pytestmark = pytest.mark.timeout(90)


def sleeper() -> subprocess.Popen[bytes]:
    """A process that is no worker (stands in for the guardian, the template, a shell)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def pipe_fd(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_NONBLOCK)


MARKER = "marker"


def caught_up(harness: Harness, fd: int, pid: int) -> None:
    """Until an observe-only timer of ``pid`` written now has expired and been reported:
    the timer server has read, judged and acted on everything written before it."""
    os.write(fd, encode(TimerMessage(pid, MARKER, time.time() - 1, 0)))
    wait_for(
        lambda: any(e == "timer_expired" and f.get("scope") == MARKER for e, f in harness.events),
        10,
        "the timer server to reach a later timer",
    )


def expired(harness: Harness) -> list[dict[str, object]]:
    """The timer_expired events, the marker's left out."""
    return [f for e, f in harness.events if e == "timer_expired" and f.get("scope") != MARKER]


def fast(**kw: object) -> MonitorConfig:
    return MonitorConfig(
        **{"check_interval": 0.05, "stack_dump_wait": 0.2, "term_grace": 1.0, **kw}
    )  # type: ignore[arg-type]


# -- who may be signalled ------------------------------------------------------------


def test_expired_timer_of_a_non_worker_signals_nothing(harness: Harness) -> None:
    mon = harness.start(fast())
    worker = harness.spawn(0, "healthy", "2000", "0.05")
    mon.begin_attempt(0, {0: worker.pid})
    bystander = sleeper()
    fd = pipe_fd(mon.pipe_path)
    try:
        for _ in range(3):  # logged once, however often it is asked
            os.write(fd, encode(TimerMessage(bystander.pid, "evil", time.time() - 1, 9)))
        wait_for(
            lambda: any(
                e == "timer_expired" and f["pid"] == bystander.pid for e, f in harness.events
            ),
            10,
            "the refusal to be logged",
        )
        caught_up(harness, fd, worker.pid)  # later server rounds: still nothing sent
        assert bystander.poll() is None and worker.poll() is None
        refused = expired(harness)
        assert len(refused) == 1 and refused[0]["reaped"] is False
        assert mon.poll_hangs() == []
    finally:
        os.close(fd)
        bystander.kill()
        bystander.wait()


def test_control_request_from_a_vanished_or_foreign_pid_does_not_stop_the_job(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_requests, "CONTROL_GRACE", 0.3)
    mon = harness.start(fast())
    worker = harness.spawn(0, "healthy", "2000", "0.05")
    mon.begin_attempt(0, {0: worker.pid})
    bystander = sleeper()
    fd = pipe_fd(mon.pipe_path)
    try:
        for pid in (gone_pid(), bystander.pid):
            os.write(fd, encode(ControlMessage(pid, 0, ControlAction.SHUTDOWN_WORKLOAD)))
        got = []

        def refused_twice() -> bool:
            got.extend(mon.poll_requests())  # as the supervisor does every interval
            return sum(e == "control_request_refused" for e, _ in harness.events) == 2

        wait_for(refused_twice, 10, "both requests refused")
        assert got == [] and mon.poll_requests() == []
        # A worker's own request still goes through, with its registered rank.
        os.write(fd, encode(ControlMessage(worker.pid, 5, ControlAction.EXCLUDE_NODE)))
        (req,) = wait_for(mon.poll_requests, 10, "the worker's request")
        assert req.pid == worker.pid and req.global_rank == 0
    finally:
        os.close(fd)
        bystander.kill()
        bystander.wait()


# -- bad signals ---------------------------------------------------------------------


def test_invalid_signal_is_refused_by_the_client(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="timer signal 99 is not a signal"):
        TimerClient(str(tmp_path / "p"), sig=99)
    with pytest.raises(ValueError, match="timer signal 99"), timer_mod.expires(1, sig=99):
        pass


def test_worker_with_an_invalid_signal_timer_is_still_reaped(harness: Harness) -> None:
    mon = harness.start(fast(), nranks=2)
    bad = harness.spawn(0, "healthy", "2000", "0.05")
    good = harness.spawn(1, "healthy", "2000", "0.05")
    mon.begin_attempt(0, {0: bad.pid, 1: good.pid})
    fd = pipe_fd(mon.pipe_path)
    try:
        # Both in one write, so one round handles both: the bad one must not drop the other.
        due = time.time() + 0.3
        os.write(
            fd,
            encode(TimerMessage(bad.pid, "bad_sig", due, 99))
            + encode(TimerMessage(good.pid, "good_sig", due, int(signal.SIGTERM))),
        )
        assert bad.wait(timeout=15) == -signal.SIGKILL
        assert good.wait(timeout=15) == -signal.SIGTERM
    finally:
        os.close(fd)
    assert any(e == "monitor_bad_request" and "signal 99" in f["reason"] for e, f in harness.events)


def test_signal_zero_only_observes(harness: Harness) -> None:
    mon = harness.start(fast())
    worker = harness.spawn(0, "healthy", "2000", "0.05")
    mon.begin_attempt(0, {0: worker.pid})
    client = TimerClient(str(mon.pipe_path), sig=0)
    fd = pipe_fd(mon.pipe_path)
    try:
        os.write(fd, encode(TimerMessage(worker.pid, "watched", time.time() + 0.1, client.signal)))
        wait_for(
            lambda: any(
                e == "timer_expired" and f.get("scope") == "watched" for e, f in harness.events
            ),
            10,
            "the expiry to be reported",
        )
        caught_up(harness, fd, worker.pid)
        assert worker.poll() is None
        assert mon.poll_hangs() == []
        (ev,) = expired(harness)
        assert ev["reaped"] is False and ev["signal"] == 0
    finally:
        os.close(fd)
        client.close()


def test_client_default_signal_is_torchs() -> None:
    pytest.importorskip("torch")
    from torch.distributed.elastic.timer import FileTimerClient

    assert TimerClient("/nonexistent").signal == FileTimerClient("/nonexistent").signal


# -- parsing and draining --------------------------------------------------------------


def test_deeply_nested_json_is_dropped_and_its_neighbours_kept(
    server: tuple[TimerServer, list[ExpiredTimer]],
) -> None:
    srv, _ = server
    child = sleeper()
    fd = pipe_fd(srv.path)
    try:
        depth = (PIPE_BUF - 100) // 2
        nested = b'{"a":' + b"[" * depth + b"]" * depth + b"}\n"
        os.write(fd, nested + encode(TimerMessage(child.pid, "kept", time.time() + 60, 9)))
        srv.run_once()
        assert srv.active_timers == 1 and srv.dropped == 1
    finally:
        os.close(fd)
        child.kill()
        child.wait()


def test_flood_of_empty_lines_does_not_delay_reaping(tmp_path: Path) -> None:
    seen: dict[str, float] = {}
    done = threading.Event()

    def on_expired(t: ExpiredTimer) -> None:
        seen[t.scope_id] = time.time()
        done.set()

    srv = TimerServer(tmp_path / "timer.pipe", on_expired=on_expired, max_interval=0.05)
    srv.start()
    child = sleeper()
    stop = threading.Event()
    fd = pipe_fd(srv.path)

    full = threading.Event()

    def flood() -> None:
        block = b"\n" * 4096
        while not stop.is_set():
            try:
                os.write(fd, block)
            except BlockingIOError:
                full.set()
                time.sleep(0.0005)

    flooder = threading.Thread(target=flood, daemon=True)
    try:
        flooder.start()
        assert full.wait(10), "the flood never filled the pipe"  # before the timer goes in
        due = time.time() + 0.5
        line = encode(TimerMessage(child.pid, "flooded", due, 9))
        wfd = pipe_fd(srv.path)
        deadline = time.monotonic() + 10
        while True:
            try:
                os.write(wfd, line)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "pipe never drained"
                time.sleep(0.001)
        os.close(wfd)
        assert done.wait(10), "the timer was never reaped during the flood"
        assert seen["flooded"] - due < 1.0
    finally:
        stop.set()
        flooder.join(5)
        os.close(fd)
        srv.stop()
        child.kill()
        child.wait()


def test_timer_table_is_capped_and_swept(
    server: tuple[TimerServer, list[ExpiredTimer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, _ = server
    srv.max_timers_per_pid = 100
    dead = gone_pid()
    child = sleeper()
    fd = pipe_fd(srv.path)
    far = time.time() + 600

    def send(lines: list[bytes]) -> None:
        for i in range(0, len(lines), 50):
            os.write(fd, b"".join(lines[i : i + 50]))
            srv.run_once()

    try:
        send([encode(TimerMessage(dead, f"s{i}", far, 9)) for i in range(5000)])
        assert srv.active_timers == 0 and srv.refused == 5000
        send([encode(TimerMessage(child.pid, f"s{i}", far, 9)) for i in range(300)])
        assert srv.active_timers == 100
        child.kill()
        child.wait()
        wait_for(lambda: (srv.run_once(0.05), srv.active_timers == 0)[1], 10, "the sweep")
    finally:
        os.close(fd)


# -- shared memory ---------------------------------------------------------------------

HOSTILE = [-1.0, -math.inf, math.nan, 5e-324, 1e-9, 1e300, -5e-324]


def _slot_offsets() -> dict[str, int]:
    return {
        "hb_initial": layout.OFF_HB_INITIAL,
        "hb": layout.OFF_HB,
        "oos": layout.OFF_OOS,
        "limit0": layout.OFF_LIMIT,
        "last_hb": layout.OFF_LAST_HB,
        "attach": layout.OFF_ATTACH,
        "oos_start": layout.OFF_OOS_START,
        "open0": layout.OFF_OPEN,
    }


def test_out_of_range_slot_numbers_never_kill_a_healthy_rank(harness: Harness) -> None:
    # Every check armed, generously: a kill can only come from believing a bad number.
    mon = harness.start(
        fast(hb_timeout=30, out_of_section_timeout=30, section_timeouts={"step": 30})
    )
    worker = harness.spawn(0, "healthy", "2000", "0.01")
    mon.begin_attempt(0, {0: worker.pid})
    harness.wait_ready(0)
    mm, _ = layout.open_segment(mon.shm_path)
    base = layout.slot_offset(0)
    try:
        for value in HOSTILE:
            for off in _slot_offsets().values():
                struct.pack_into("=d", mm, base + off, value)
            assert mon.wait_scanned_since(time.monotonic(), 10), "no scan saw it"
        assert worker.poll() is None
        assert mon.poll_hangs() == []
        bad = [f for e, f in harness.events if e == "monitor_bad_slot"]
        assert bad and {"hb", "hb_initial", "oos"} <= {x for f in bad for x in f["fields"]}
    finally:
        mm.close()


def test_scribbled_header_does_not_fail_the_next_attempt(harness: Harness) -> None:
    mon = harness.start(fast())
    mm, _ = layout.open_segment(mon.shm_path)
    mm[0 : layout.HEADER_SIZE] = os.urandom(layout.HEADER_SIZE)
    mm.close()
    mon.begin_attempt(0, {})
    mon.end_attempt()
    mm2, nslots = layout.open_segment(mon.shm_path)  # what the next attempt's workers do
    assert nslots == 1
    mm2.close()
    worker = harness.spawn(0, "healthy", "3", "0.01")
    mon.begin_attempt(1, {0: worker.pid})
    assert worker.wait(timeout=30) == 0, harness.stderr_path(0).read_text()


def test_monitor_segment_files_are_gone_after_stop(harness: Harness) -> None:
    mon: NodeMonitor = harness.start(fast())
    for attempt in range(3):
        mon.begin_attempt(attempt, {})
        mon.end_attempt()
    run_dir = mon.run_dir
    mon.stop()
    harness.monitor = None
    assert not run_dir.exists()


def test_stalwart_timer_is_an_importable_module() -> None:
    # A fresh interpreter: in this one an earlier attribute access may have loaded it.
    code = (
        "import stalwart.timer\n"
        "from stalwart.timer import expires, TimerClient\n"
        "import stalwart\n"
        "assert stalwart.timer.expires is expires\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_workers_child_is_still_reaped_by_its_own_timer(harness: Harness, tmp_path: Path) -> None:
    mon = harness.start(fast())
    pidfile = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "c.wait(); time.sleep(120)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", code])
    harness.procs.append(worker)  # type: ignore[arg-type]
    mon.begin_attempt(0, {0: worker.pid})
    child = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 30, "the child"))
    fd = pipe_fd(mon.pipe_path)
    try:
        os.write(fd, encode(TimerMessage(child, "child_step", time.time() - 0.1, 15)))
        (report,) = wait_for(mon.poll_hangs, 10, "the child's hang")
        assert report.pid == child and report.section == "child_step"
    finally:
        os.close(fd)


def test_segment_reset_in_place_when_a_fresh_one_cannot_be_made(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    mon = harness.start(fast())
    (mon.run_dir / (node.SHM_NAME + ".next")).mkdir()  # where the fresh segment would go
    mm, _ = layout.open_segment(mon.shm_path)
    mm[0 : layout.HEADER_SIZE] = os.urandom(layout.HEADER_SIZE)
    mm.close()
    mon.begin_attempt(0, {})
    mon.end_attempt()
    assert "resetting it in place" in caplog.text
    mm2, nslots = layout.open_segment(mon.shm_path)
    assert nslots == 1
    mm2.close()
    (mon.run_dir / (node.SHM_NAME + ".next")).rmdir()


def test_waiting_for_a_scan_ends_when_one_ran_and_not_after_the_monitor_stopped(
    harness: Harness,
) -> None:
    # What the "nothing happened" checks above rely on: a True answer means the scanner
    # really ran past the moment, never that time merely passed.
    mon = harness.start(fast())
    assert mon.wait_scanned_since(time.monotonic(), 10)
    mon.stop()
    assert not mon.wait_scanned_since(time.monotonic(), 0.5)
