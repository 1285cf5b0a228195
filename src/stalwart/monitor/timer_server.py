"""Node side of named-pipe timers: reads requests from the FIFO and reaps expired workers.

One server per node, owned by the launcher (through NodeMonitor). Unlike torch's
FileTimerServer, it never signals its own process or process group: an expired timer
is handed to `on_expired` (NodeMonitor dumps stacks, terminates the worker and reports
a hang so the supervisor restarts). Garbage lines, oversized lines, unknown or vanished
pids are logged and dropped; the pipe is opened read-write so that writers coming and
going never produce EOF.

Bad input cannot switch reaping off: each round reads at most `MAX_DRAIN_BYTES` before
it reaps, lines are split in linear time, one line's failure never drops another's,
the table is capped per pid and swept of dead pids, and expiries come off a heap so a
large table costs nothing per round.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.base.files import untrusted
from stalwart.monitor.wire import (
    PIPE_BUF,
    VALID_SIGNALS,
    BadMessage,
    ControlMessage,
    TimerMessage,
    decode,
)

log = logging.getLogger(__name__)

LogEvent = Callable[[Event, dict[str, Any]], None]

#: Signal used for a timer whose signal is not one of this system's (and torch's default).
DEFAULT_SIGNAL = int(signal.SIGKILL)
#: Bytes read per round before expired timers are reaped again, so a flood cannot delay them.
MAX_DRAIN_BYTES = 1 << 20
#: Timers one process may hold at once; more are refused (a client leaking scope names).
MAX_TIMERS_PER_PID = 4096
#: Processes with timers at once; a backstop, since timers of dead processes are swept.
MAX_PIDS = 16384
#: Seconds between sweeps that drop the timers of processes that ended.
SWEEP_INTERVAL = 1.0


@dataclasses.dataclass(frozen=True)
class ExpiredTimer:
    pid: int
    scope_id: str
    signal: int
    expiration_time: float
    timeout_hint: float | None  # seconds between acquire and expiry, when the acquire was seen


@dataclasses.dataclass(frozen=True)
class _Entry:
    msg: TimerMessage
    seen: float  # wall clock at receipt
    seq: int  # matches the heap item that will expire it


def default_reap(timer: ExpiredTimer) -> None:
    """Stand-alone reaping: the requested signal to the worker's pid, never to ourselves."""
    procs.signal_pid(timer.pid, timer.signal)


class _Throttle:
    """Lets the first `burst` occurrences through, then one in `every`: a client stuck
    in a loop must not flood the log or the events."""

    def __init__(self, burst: int = 10, every: int = 1000) -> None:
        self.count = 0
        self.burst = burst
        self.every = every

    def __call__(self) -> bool:
        self.count += 1
        return self.count <= self.burst or self.count % self.every == 0


class TimerServer:
    """Reads one FIFO; `run_once` for tests, `start`/`stop` for a background thread."""

    def __init__(
        self,
        path: Path,
        on_expired: Callable[[ExpiredTimer], None] = default_reap,
        on_control: Callable[[ControlMessage], None] | None = None,
        log_event: LogEvent | None = None,
        max_interval: float = 0.1,
        max_timers_per_pid: int = MAX_TIMERS_PER_PID,
        max_pids: int = MAX_PIDS,
        is_alive: Callable[[int], bool] = procs.is_alive,
    ) -> None:
        self.path = Path(path)
        # Injected so that torch's FileTimerServer shape can route it through its own
        # overridable `is_process_running`.
        self.is_alive = is_alive
        self.on_expired = on_expired
        self.on_control = on_control
        self.log_event = log_event
        self.max_interval = max_interval
        self.max_timers_per_pid = max_timers_per_pid
        self.max_pids = max_pids
        self._fd = -1
        self._buf = b""
        self._discarding = False
        self._timers: dict[int, dict[str, _Entry]] = {}
        # (expiration, seq, pid, scope); stale items (released or re-armed) are skipped.
        self._heap: list[tuple[float, int, int, str]] = []
        self._seq = itertools.count()
        self._count = 0
        self._next_sweep = 0.0
        # Guards the table: the supervisor's thread calls forget_pid/clear.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0  # malformed lines, for tests and metrics
        self.refused = 0  # well-formed timers not kept (dead pid, table full)
        self.received = 0  # well-formed acquire and release requests read
        self._drop_throttle = _Throttle()
        self._refuse_throttle = _Throttle()
        self._observe_throttle = _Throttle()

    # -- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Creates the 0600 FIFO (if missing) and opens it for reading."""
        if self._fd >= 0:
            return
        try:
            os.mkfifo(self.path, 0o600)
        except FileExistsError:
            if untrusted(os.lstat(self.path), "fifo", private=False) is not None:
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
            if self._heap:
                wait = min(wait, max(0.0, self._heap[0][0] - time.time()))
        return wait

    # -- one round -------------------------------------------------------------------
    def run_once(self, timeout: float = 0.0) -> None:
        """Waits up to `timeout` s for input, handles what arrived (up to MAX_DRAIN_BYTES),
        then reaps."""
        self.open()
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if poller.poll(timeout * 1000):
            self._drain()
        self._reap_expired()
        self._sweep()

    def _drain(self) -> None:
        total = 0
        while total < MAX_DRAIN_BYTES:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            total += len(chunk)
            self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        if self._discarding:
            end = chunk.find(b"\n")
            if end < 0:
                return
            chunk = chunk[end + 1 :]
            self._discarding = False
        # One split per chunk: linear in its size, however many (empty) lines it holds.
        lines = (self._buf + chunk).split(b"\n") if self._buf else chunk.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if not line:
                continue
            try:
                self._handle_line(line)
            except Exception:  # one request's failure must not cost the others
                self._drop("request failed", line)
                log.debug("request failed", exc_info=True)
        if len(self._buf) >= PIPE_BUF:
            # No client writes lines this long; drop it rather than buffer without bound.
            self._drop("oversized line", self._buf[:80])
            self._buf = b""
            self._discarding = True

    def _drop(self, why: str, sample: bytes) -> None:
        self.dropped += 1
        if not self._drop_throttle():
            return
        log.warning("timer server dropped a request: %s (%r)", why, sample[:80])
        if self.log_event is not None:
            self.log_event(Event.MONITOR_BAD_REQUEST, {"reason": why, "dropped": self.dropped})

    def _refuse(self, why: str) -> None:
        """A well-formed request that is not kept (dead pid, table full)."""
        self.refused += 1
        if self._refuse_throttle():
            log.info("timer server refused a request: %s (%d so far)", why, self.refused)

    def _handle_line(self, line: bytes) -> None:
        if len(line) > PIPE_BUF:
            self._drop("oversized line", line[:80])
            return
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
        self.received += 1
        if msg.is_release:
            self._release(msg.pid, msg.scope_id)
            return
        if msg.signal > 0 and msg.signal not in VALID_SIGNALS:
            # Reaped all the same: a hung worker must not run forever because of a typo.
            self._drop(
                f"timer {msg.scope_id!r} of pid {msg.pid} names signal {msg.signal}, "
                f"which does not exist; it will be reaped with SIGKILL",
                line,
            )
            msg = dataclasses.replace(msg, signal=DEFAULT_SIGNAL)
        self._acquire(msg)

    def _acquire(self, msg: TimerMessage) -> None:
        with self._lock:
            scopes = self._timers.get(msg.pid)
            if scopes is None:
                full = len(self._timers) >= self.max_pids
            else:
                full = msg.scope_id not in scopes and len(scopes) >= self.max_timers_per_pid
        if scopes is None and not full and not self.is_alive(msg.pid):
            self._refuse(f"timer {msg.scope_id!r} for pid {msg.pid}, which does not exist")
            return
        if full:
            self._refuse(f"timer {msg.scope_id!r}: the table is full for pid {msg.pid}")
            return
        seq = next(self._seq)
        with self._lock:
            scopes = self._timers.setdefault(msg.pid, {})
            if msg.scope_id not in scopes:
                self._count += 1
            scopes[msg.scope_id] = _Entry(msg, time.time(), seq)
            heapq.heappush(self._heap, (msg.expiration_time, seq, msg.pid, msg.scope_id))
            if len(self._heap) > 2 * self._count + 1024:
                self._rebuild_heap()

    def _release(self, pid: int, scope: str) -> None:
        with self._lock:
            scopes = self._timers.get(pid)
            if scopes is not None and scopes.pop(scope, None) is not None:
                self._count -= 1
                if not scopes:
                    del self._timers[pid]

    def _rebuild_heap(self) -> None:
        """Drops stale heap items (called with the lock held)."""
        self._heap = [
            (e.msg.expiration_time, e.seq, pid, scope)
            for pid, scopes in self._timers.items()
            for scope, e in scopes.items()
        ]
        heapq.heapify(self._heap)

    def _pop_expired(self, now: float) -> dict[int, list[_Entry]]:
        expired: dict[int, list[_Entry]] = {}
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, seq, pid, scope = heapq.heappop(self._heap)
                entry = self._timers.get(pid, {}).get(scope)
                if entry is not None and entry.seq == seq:
                    expired.setdefault(pid, []).append(entry)
            for pid, entries in expired.items():
                scopes = self._timers.get(pid, {})
                if any(e.msg.signal > 0 for e in entries):
                    # One expiry ends the process, so every other timer it held goes too.
                    self._count -= len(scopes)
                    self._timers.pop(pid, None)
                else:
                    for e in entries:
                        if scopes.pop(e.msg.scope_id, None) is not None:
                            self._count -= 1
                    if not scopes:
                        self._timers.pop(pid, None)
        return expired

    def _reap_expired(self) -> None:
        now = time.time()
        for pid, entries in self._pop_expired(now).items():
            try:
                self._expire(pid, entries)
            except Exception:  # one timer's failure must not keep the others from reaping
                log.exception("handling the expired timers of pid %d failed", pid)

    def _expire(self, pid: int, entries: list[_Entry]) -> None:
        # As torch does: the earliest expired timer that names a signal decides.
        entries.sort(key=lambda e: e.msg.expiration_time)
        found = next((e for e in entries if e.msg.signal > 0), None)
        if found is None:
            # torch's meaning of a signal <= 0: report the expiry, never reap.
            for m in (e.msg for e in entries):
                if self._observe_throttle():
                    log.warning(
                        "timer %r of pid %d expired; signal %d: observed, not reaped",
                        m.scope_id,
                        pid,
                        m.signal,
                    )
                    if self.log_event is not None:
                        self.log_event(
                            Event.TIMER_EXPIRED,
                            {"pid": pid, "scope": m.scope_id, "signal": m.signal, "reaped": False},
                        )
            return
        chosen = found.msg
        if pid == os.getpid():
            if self._refuse_throttle():
                log.error("timer %r names the monitor's own pid; not reaping", chosen.scope_id)
                if self.log_event is not None:
                    self.log_event(
                        Event.TIMER_EXPIRED,
                        {"pid": pid, "scope": chosen.scope_id, "rank": None, "reaped": False},
                    )
            return
        if not self.is_alive(pid):
            if self._refuse_throttle():
                log.info("timer %r of pid %d expired after it ended", chosen.scope_id, pid)
            return
        self.on_expired(
            ExpiredTimer(
                pid=pid,
                scope_id=chosen.scope_id,
                signal=chosen.signal,
                expiration_time=chosen.expiration_time,
                timeout_hint=max(0.0, chosen.expiration_time - found.seen),
            )
        )

    def _sweep(self) -> None:
        """Drops the timers of processes that ended (at most once per SWEEP_INTERVAL)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL
        with self._lock:
            pids = list(self._timers)
        dead = [pid for pid in pids if not self.is_alive(pid)]
        if not dead:
            return
        with self._lock:
            for pid in dead:
                self._count -= len(self._timers.pop(pid, {}))
            self._rebuild_heap()
        log.info("dropped the timers of %d processes that ended", len(dead))

    def forget_pid(self, pid: int) -> None:
        """Drops every timer of `pid` (called when the supervisor stops a worker)."""
        with self._lock:
            self._count -= len(self._timers.pop(pid, {}))

    def timers(self) -> dict[tuple[int, str], TimerMessage]:
        """A snapshot of the armed timers by (pid, scope)."""
        with self._lock:
            return {
                (pid, scope): entry.msg
                for pid, scopes in self._timers.items()
                for scope, entry in scopes.items()
            }

    @property
    def active_timers(self) -> int:
        with self._lock:
            return self._count
