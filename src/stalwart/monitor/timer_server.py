"""Node side of named-pipe timers: reads requests from the FIFO and reaps expired workers.

One server per node, owned by the launcher (through NodeMonitor). Unlike torch's
FileTimerServer, it never signals its own process or process group: an expired timer
is handed to `on_expired` (NodeMonitor dumps stacks, terminates the worker and reports
a hang so the supervisor restarts). Garbage lines, oversized lines, unknown or vanished
pids are logged and dropped; the pipe is opened read-write so that writers coming and
going never produce EOF.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.monitor import procs
from stalwart.monitor.wire import PIPE_BUF, BadMessage, ControlMessage, TimerMessage, decode

log = logging.getLogger(__name__)

LogEvent = Callable[[str, dict[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class ExpiredTimer:
    pid: int
    scope_id: str
    signal: int
    expiration_time: float
    timeout_hint: float | None  # seconds between acquire and expiry, when the acquire was seen


def default_reap(timer: ExpiredTimer) -> None:
    """Stand-alone reaping: the requested signal to the worker's pid, never to ourselves."""
    procs.signal_pid(timer.pid, timer.signal or signal.SIGKILL)


class TimerServer:
    """Reads one FIFO; `run_once` for tests, `start`/`stop` for a background thread."""

    def __init__(
        self,
        path: Path,
        on_expired: Callable[[ExpiredTimer], None] = default_reap,
        on_control: Callable[[ControlMessage], None] | None = None,
        log_event: LogEvent | None = None,
        max_interval: float = 0.1,
    ) -> None:
        self.path = Path(path)
        self.on_expired = on_expired
        self.on_control = on_control
        self.log_event = log_event
        self.max_interval = max_interval
        self._fd = -1
        self._buf = b""
        self._discarding = False
        self._timers: dict[tuple[int, str], tuple[TimerMessage, float]] = {}
        # Guards _timers: the supervisor's thread calls forget_pid/clear.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0  # malformed lines, for tests and metrics

    # -- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Creates the 0600 FIFO (if missing) and opens it for reading."""
        if self._fd >= 0:
            return
        try:
            os.mkfifo(self.path, 0o600)
        except FileExistsError:
            st = os.lstat(self.path)
            if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.getuid():
                raise RuntimeError(f"{self.path} exists and is not our FIFO") from None
        os.chmod(self.path, 0o600)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)

    def start(self) -> None:
        self.open()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, name="stalwart-timer-server", daemon=True
        )
        self._thread.start()

    def stop(self, remove: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            self.path.unlink(missing_ok=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once(self._next_wait())
            except Exception:  # the server must outlive any one bad request
                log.exception("timer server iteration failed")
                self._stop.wait(self.max_interval)

    def _next_wait(self) -> float:
        wait = self.max_interval
        with self._lock:
            if self._timers:
                soonest = min(msg.expiration_time for msg, _ in self._timers.values())
                wait = min(wait, max(0.0, soonest - time.time()))
        return wait

    # -- one round -------------------------------------------------------------------
    def run_once(self, timeout: float = 0.0) -> None:
        """Waits up to `timeout` s for input, handles every complete line, then reaps."""
        self.open()
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if poller.poll(timeout * 1000):
            self._drain()
        self._reap_expired()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            self._buf += chunk
            while True:
                line, sep, rest = self._buf.partition(b"\n")
                if not sep:
                    break
                self._buf = rest
                if self._discarding:
                    self._discarding = False  # end of an oversized line
                    continue
                self._handle_line(line)
            if len(self._buf) >= PIPE_BUF:
                # No client writes lines this long; drop it rather than buffer without bound.
                self._drop("oversized line", self._buf[:80])
                self._buf = b""
                self._discarding = True

    def _drop(self, why: str, sample: bytes) -> None:
        self.dropped += 1
        # A client stuck writing garbage in a loop must not flood the log or the events.
        if self.dropped > 10 and self.dropped % 1000:
            return
        log.warning("timer server dropped a request: %s (%r)", why, sample[:80])
        if self.log_event is not None:
            self.log_event("monitor_bad_request", {"reason": why, "dropped": self.dropped})

    def _handle_line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            msg = decode(line)
        except BadMessage as exc:
            self._drop(str(exc), line)
            return
        if isinstance(msg, ControlMessage):
            if self.on_control is not None:
                self.on_control(msg)
            return
        key = (msg.pid, msg.scope_id)
        with self._lock:
            if msg.is_release:
                self._timers.pop(key, None)
            else:
                self._timers[key] = (msg, time.time())

    def _reap_expired(self) -> None:
        now = time.time()
        expired_pids: dict[int, tuple[TimerMessage, float]] = {}
        with self._lock:
            for msg, seen in self._timers.values():
                if msg.expiration_time <= now and msg.pid not in expired_pids:
                    expired_pids[msg.pid] = (msg, seen)
            # One expiry ends the process, so every other timer it held goes too.
            for key in [k for k in self._timers if k[0] in expired_pids]:
                del self._timers[key]
        for pid, (msg, seen) in expired_pids.items():
            if pid == os.getpid():
                log.error("timer scope %r names the monitor's own pid; not reaping", msg.scope_id)
                continue
            if not procs.is_alive(pid):
                log.info("timer %r of pid %d expired after the process ended", msg.scope_id, pid)
                continue
            self.on_expired(
                ExpiredTimer(
                    pid=pid,
                    scope_id=msg.scope_id,
                    signal=msg.signal,
                    expiration_time=msg.expiration_time,
                    timeout_hint=max(0.0, msg.expiration_time - seen),
                )
            )

    def forget_pid(self, pid: int) -> None:
        """Drops every timer of `pid` (called when the supervisor stops a worker)."""
        with self._lock:
            for key in [k for k in self._timers if k[0] == pid]:
                del self._timers[key]

    def clear(self) -> None:
        with self._lock:
            self._timers.clear()

    @property
    def active_timers(self) -> int:
        with self._lock:
            return len(self._timers)
