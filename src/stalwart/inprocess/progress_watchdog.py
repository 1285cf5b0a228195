"""NVIDIA ``inprocess`` 0.4's ``progress_watchdog`` module: a thread that keeps telling a
sink when the main thread last ran Python code, for programs that drive one themselves.

The wrapper does not use it: its own clock (``progress.ProgressClock``) is shared with
the monitor process through memory.  Both ask the same question the same way: a
request queued with ``Py_AddPendingCall`` only runs when the main thread runs
bytecode, and the request (``MainThreadProbe``) is libc's ``sem_post``, so no Python
runs on the main thread for it and an asynchronous restart cannot land inside it.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from datetime import timedelta
from typing import Protocol

from .errors import InternalError
from .progress import MainThreadProbe

# Probes are never freed (a request the interpreter still holds must find its
# semaphore); a watchdog that ends with none outstanding gives its own back for reuse.
_idle_probes: list[MainThreadProbe] = []
_retired_probes: list[MainThreadProbe] = []
_probes_lock = threading.Lock()


def _lend_probe() -> MainThreadProbe | None:
    with _probes_lock:
        if _idle_probes:
            return _idle_probes.pop()
    try:
        return MainThreadProbe()
    except (OSError, AttributeError):
        return None  # no POSIX semaphores: the thread's own clock is all there is


def _return_probe(probe: MainThreadProbe) -> None:
    with _probes_lock:
        (_retired_probes if probe.outstanding else _idle_probes).append(probe)


@dataclasses.dataclass
class Timestamp:
    """When the main thread last ran (``auto``) and last called ``ping()`` (``manual``),
    in ``time.monotonic()`` seconds; None when never."""

    auto: float | None = None
    manual: float | None = None

    def is_timed_out(self, timeout: timedelta) -> bool:
        """Whether either time is older than ``timeout``."""
        now = time.monotonic()
        limit = timeout.total_seconds()
        return any(t is not None and now - t > limit for t in (self.auto, self.manual))


class TimestampSink(Protocol):
    """What the watchdog reports to (NVIDIA's passes its monitor process)."""

    def send_timestamp(self, timestamp: Timestamp) -> None: ...


class ProgressWatchdog(threading.Thread):
    """Every ``interval``, asks the main thread to show it runs and sends the sink the
    time of the last request it ran.

    ``pause_and_synchronize()`` stops the asking once the outstanding request has been
    answered (so none is left queued) and sends a fresh timestamp; ``resume()`` starts
    again; ``shutdown()`` pauses and ends the thread. ``resume()`` on a thread that is
    not running raises ``RuntimeError``.
    """

    def __init__(self, rank: int, monitor_process: TimestampSink, interval: timedelta) -> None:
        super().__init__(name=f"{type(self).__name__}-{rank}", daemon=True)
        seconds = interval.total_seconds() if isinstance(interval, timedelta) else interval
        if not isinstance(seconds, int | float) or not seconds > 0:
            raise ValueError(f"interval must be a positive timedelta, got {interval!r}")
        self.rank = rank
        self.monitor_process = monitor_process
        self.interval = timedelta(seconds=seconds)
        self.timestamp = Timestamp(auto=time.monotonic())
        self._poll = sys.getswitchinterval()
        self._probe = _lend_probe()
        self._asked_at = self.timestamp.auto
        self._seen = self.timestamp.auto
        self._wake = threading.Event()
        self._pause_requested = threading.Event()
        self._paused = threading.Event()
        self._stop_requested = threading.Event()

    def reset(self) -> None:
        """Start afresh from now (no ``ping()`` yet) and tell the sink."""
        self.timestamp = Timestamp(auto=time.monotonic())
        self.send()

    def ping(self) -> None:
        """The program's own sign of progress."""
        self.timestamp.manual = time.monotonic()
        self.send()

    def send(self) -> None:
        self.monitor_process.send_timestamp(self.timestamp)

    def _collect(self) -> None:
        if self._probe is None:
            self._seen = time.monotonic()
        elif self._probe.answered():
            # The request ran some time after it was queued: the queueing time is the
            # latest moment the main thread is known to have been running.
            self._seen = self._asked_at

    def _drain(self) -> None:
        """Wait for the outstanding request to be run, so none is left queued."""
        while self._probe is not None and self._probe.outstanding:
            self._collect()
            if self._probe.outstanding:
                time.sleep(self._poll)

    def run(self) -> None:
        try:
            while not self._stop_requested.is_set():
                self._wake.wait(self.interval.total_seconds())
                self._wake.clear()
                if self._pause_requested.is_set():
                    self._drain()
                    self._paused.set()
                    while self._pause_requested.is_set() and not self._stop_requested.is_set():
                        self._wake.wait(self._poll)
                        self._wake.clear()
                    self._paused.clear()
                if self._stop_requested.is_set():
                    break
                self._collect()
                if self._probe is not None and self._probe.ask():
                    self._asked_at = time.monotonic()
                self.timestamp.auto = self._seen
                self.send()
        finally:
            self._paused.set()
            if self._probe is not None:
                _return_probe(self._probe)

    def pause_and_synchronize(self) -> None:
        """Stop asking once the outstanding request is answered, then send a fresh
        timestamp; returns when the thread is paused."""
        self._pause_requested.set()
        self._wake.set()
        # Waited for in short steps: called on the main thread, each return to bytecode
        # lets the interpreter run the request the thread is waiting on.
        while self.is_alive() and not self._paused.wait(self._poll):
            pass
        self.reset()

    def resume(self) -> None:
        if not self.is_alive():
            raise RuntimeError(f"{self.name} is not running: resume() needs a started thread")
        self._pause_requested.clear()
        self._wake.set()
        while self._paused.is_set() and self.is_alive():
            time.sleep(self._poll)

    def shutdown(self, timeout: float | None = None) -> None:
        """Pause (draining the outstanding request), then end the thread; a no-op when it
        is not running. ``InternalError`` when it did not end within ``timeout``."""
        if not self.is_alive():
            return
        self.pause_and_synchronize()
        self._stop_requested.set()
        self._wake.set()
        self.join(timeout)
        if self.is_alive():
            raise InternalError(f"{self.name} did not end within {timeout} s")
