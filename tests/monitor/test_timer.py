"""Named-pipe timers: expiry reaps the worker, and the server shrugs off bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stalwart.monitor import ControlAction, HangKind, MonitorConfig, TimerClient
from stalwart.monitor.pipe import PipeError
from stalwart.monitor.timer_server import ExpiredTimer, TimerServer
from stalwart.monitor.wire import PIPE_BUF, MessageTooLarge, TimerMessage, decode, encode
from tests.helpers import wait_for

from .conftest import Harness


@pytest.mark.timeout(60)
def test_expired_timer_reaps_the_worker_not_the_server(harness: Harness) -> None:
    mon = harness.start(MonitorConfig(check_interval=0.05, stack_dump_wait=0.3))
    proc = harness.spawn(0, "timer_hang", "1.0")
    mon.begin_attempt(3, {0: proc.pid}, stderr_paths={0: harness.stderr_path(0)})
    harness.wait_ready(0)
    reports = wait_for(mon.poll_hangs, 10, "timer hang report")
    assert reports[0].kind is HangKind.TIMER
    assert reports[0].section == "train_step" and reports[0].pid == proc.pid
    assert 0.5 < reports[0].timeout <= 1.0
    assert "worker.py" in reports[0].stacks
    # Stacks first, then the timer's own signal: SIGKILL by default, as torch's client.
    assert proc.wait(timeout=10) == -signal.SIGKILL
    event = dict(harness.events)["hang_detected"]
    assert event["kind"] == "timer" and event["attempt"] == 3


@pytest.mark.timeout(60)
def test_many_unpaced_timers_and_a_control_request(harness: Harness) -> None:
    mon = harness.start(MonitorConfig())
    timers = harness.spawn(0, "timer_ok", "3000")
    mon.begin_attempt(0, {0: timers.pid})
    assert timers.wait(timeout=40) == 0, harness.stderr_path(0).read_text()
    control = harness.spawn(0, "control", "exclude_node")
    mon.begin_attempt(1, {0: control.pid})
    assert control.wait(timeout=30) == 0, harness.stderr_path(0).read_text()
    reqs = wait_for(mon.poll_requests, 5, "control request")
    assert reqs[0].action is ControlAction.EXCLUDE_NODE
    assert reqs[0].local_rank == 0 and reqs[0].global_rank == 0 and reqs[0].pid == control.pid
    assert mon.poll_hangs() == []


def test_full_pipe_is_a_clear_error_then_paced(
    server: tuple[TimerServer, list[ExpiredTimer]],
) -> None:
    srv, _ = server
    client = TimerClient(str(srv.path))
    client._writer.full_pipe_wait = 0.2
    with pytest.raises(PipeError, match="stayed full"):
        for _ in range(100_000):
            client.acquire("s", time.time() + 60)
    srv.run_once()  # drain
    # With the server reading, a long burst is paced rather than refused.
    srv.start()
    for _ in range(2000):
        client.acquire("s", time.time() + 60)
        client.release("s")
    client.close()


def test_oversized_request_refused_on_the_client(
    server: tuple[TimerServer, list[ExpiredTimer]],
) -> None:
    srv, _ = server
    client = TimerClient(str(srv.path))
    with pytest.raises(MessageTooLarge, match="PIPE_BUF"):
        client.acquire("x" * PIPE_BUF, time.time() + 1)
    srv.run_once()
    assert srv.active_timers == 0 and srv.dropped == 0


def test_server_survives_garbage_unknown_and_vanished_pids(
    server: tuple[TimerServer, list[ExpiredTimer]],
) -> None:
    srv, expired = server
    fd = os.open(srv.path, os.O_WRONLY | os.O_NONBLOCK)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        for junk in (
            b"not json\n",
            b"\xff\xfe\n",
            b"[1, 2]\n",
            b'{"version": 1}\n',
            b'{"version": 9, "pid": 5}\n',
            b'{"version": 1, "pid": true, "scope_id": "a", "expiration_time": 1, "signal": 9}\n',
            b'{"version": 1, "pid": 5, "scope_id": "a", "expiration_time": NaN, "signal": 9}\n',
            b"y" * 3000,
            b"y" * 3000 + b"\n",
        ):
            os.write(fd, junk)
            srv.run_once()
        past = time.time() - 1
        for pid in (gone.pid, os.getpid(), child.pid):
            os.write(fd, encode(TimerMessage(pid, "scope", past, signal.SIGKILL)))
        srv.run_once()
        assert srv.dropped == 8
        assert [t.pid for t in expired] == [child.pid]  # not the vanished one, not ourselves
        assert srv.active_timers == 0
    finally:
        os.close(fd)
        child.kill()
        child.wait()


def test_release_and_forget_cancel_timers(server: tuple[TimerServer, list[ExpiredTimer]]) -> None:
    srv, expired = server
    client = TimerClient(str(srv.path))
    soon = time.time() + 0.05
    client._send("a", soon, 9)
    client.release("a")
    msg = encode(TimerMessage(12345678, "b", soon, 9))
    os.write(client._writer._open(), msg)
    srv.run_once()
    srv.forget_pid(12345678)
    time.sleep(0.06)
    srv.run_once()
    assert expired == []


def test_torch_file_timer_requests_are_understood() -> None:
    pytest.importorskip("torch")
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest

    line = FileTimerRequest(4242, "step", 123.5, signal.SIGKILL).to_json().encode()
    assert decode(line) == TimerMessage(4242, "step", 123.5, signal.SIGKILL)


def test_expires_without_a_server_warns_once_or_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from stalwart.monitor import envvars, timer

    monkeypatch.delenv(envvars.TIMER_FILE, raising=False)
    monkeypatch.delenv(envvars.TORCHELASTIC_TIMER_FILE, raising=False)
    monkeypatch.setattr(timer, "_warned", False)
    with timer.expires(after=1):
        pass
    with timer.expires(after=1):
        pass
    assert sum("not enforced" in r.message for r in caplog.records) == 1
    monkeypatch.setenv(envvars.STRICT, "1")
    with pytest.raises(timer.TimerUnavailableError), timer.expires(after=1):
        pass
    with pytest.raises(ValueError, match="> 0"), timer.expires(after=0):
        pass


def test_expires_with_no_reader_is_a_clear_error(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p", 0o600)
    from stalwart.monitor import timer

    with (
        pytest.raises(PipeError, match="no monitor"),
        timer.expires(1, client=TimerClient(str(tmp_path / "p"))),
    ):
        pass


def test_pipe_and_folder_are_private(harness: Harness) -> None:
    mon = harness.start(MonitorConfig())
    assert (mon.run_dir.stat().st_mode & 0o777) == 0o700
    assert (mon.pipe_path.stat().st_mode & 0o777) == 0o600
    assert (mon.shm_path.stat().st_mode & 0o777) == 0o600
    env = mon.worker_env(0, 7)
    assert env["STALWART_TIMER_FILE"] == env["TORCHELASTIC_TIMER_FILE"] == str(mon.pipe_path)
    mon.stop()
    assert not mon.pipe_path.exists() and not mon.shm_path.exists()
    harness.monitor = None


def test_threads_are_gone_after_stop(harness: Harness) -> None:
    mon = harness.start(MonitorConfig())
    mon.stop()
    harness.monitor = None
    names = {t.name for t in threading.enumerate()}
    assert "stalwart-monitor" not in names and "stalwart-timer-server" not in names
