"""torch elastic's file-based timer API (`FileTimerServer`, `FileTimerClient`,
`FileTimerRequest`, `configure`, `expires`) over stalwart's named-pipe timer server.

Code written against ``torch.distributed.elastic.timer`` runs with only its import line
changed. What differs from torch, deliberately: a request naming a pid <= 0 (a process
group to `kill(2)`), pid 1 or the server's own process is dropped or never acted on, so a
forged line in the pipe cannot signal a group or the server; the FIFO is created 0600 and
a file planted at its path is refused; oversized and malformed lines are dropped without
stopping the reaping (see `stalwart.monitor.timer_server`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal as _signal
import threading
import time
from pathlib import Path

from stalwart.base import procs
from stalwart.monitor.pipe import PipeError, PipeWriter
from stalwart.monitor.timer_server import ExpiredTimer, TimerServer
from stalwart.monitor.torch_timer import TimerClient, configure, expires
from stalwart.monitor.wire import TimerMessage, encode

log = logging.getLogger(__name__)

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "configure",
    "expires",
    "log_debug_info_for_expired_timers",
]


@dataclasses.dataclass(frozen=True)
class FileTimerRequest:
    """One acquire (expiration_time >= 0, wall clock) or release (< 0) for a worker."""

    worker_pid: int
    scope_id: str
    expiration_time: float
    signal: int = 0

    def to_json(self) -> str:
        return self._encode().decode().rstrip("\n")

    def _encode(self) -> bytes:
        return encode(
            TimerMessage(self.worker_pid, self.scope_id, self.expiration_time, self.signal)
        )


class FileTimerClient(TimerClient):
    """Sends this process's timers to the `FileTimerServer` reading `file_path`.

    Each request opens, writes and closes the pipe, so it works against torch's server
    (which reads until every writer has closed) as well as stalwart's. No server reading
    the pipe raises BrokenPipeError, as torch's client does.
    """

    def __init__(self, file_path: str, signal: int = _signal.SIGKILL) -> None:
        self._file_path = file_path
        self.signal = int(signal)
        self._writer = PipeWriter(file_path, keep_open=False)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._send_request(FileTimerRequest(os.getpid(), scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        self._send_request(FileTimerRequest(os.getpid(), scope_id, -1.0, 0))

    def _send_request(self, request: FileTimerRequest) -> None:
        try:
            self._writer.write(request._encode())
        except PipeError as exc:
            raise BrokenPipeError(
                f"could not send the timer request: no FileTimerServer is reading "
                f"{self._file_path} ({exc})"
            ) from None


def log_debug_info_for_expired_timers(run_id: str, expired_timers: dict[int, list[str]]) -> None:
    """Logs which scopes of which pids expired (called before they are reaped)."""
    if expired_timers:
        log.info("run %s: timers expired, by pid: %s", run_id, expired_timers)


class FileTimerServer:
    """Reads timer requests from the FIFO at `file_path` and reaps workers whose timers
    expire, checking at least every `max_interval` seconds."""

    def __init__(
        self, file_path: str, run_id: str, max_interval: float = 10, daemon: bool = True
    ) -> None:
        self._file_path = file_path
        self._run_id = run_id
        self._max_interval = max_interval
        self._daemon = daemon
        self._server = TimerServer(
            Path(file_path),
            on_expired=self._on_expired,
            max_interval=max_interval,
            # Through the class, so that a test (or a subclass) replacing it is heard.
            is_alive=lambda pid: type(self).is_process_running(pid),
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_progress_time = int(time.time())

    @property
    def _timers(self) -> dict[tuple[int, str], FileTimerRequest]:
        return {
            key: FileTimerRequest(m.pid, m.scope_id, m.expiration_time, m.signal)
            for key, m in self._server.timers().items()
        }

    @property
    def _request_count(self) -> int:
        return self._server.received

    def start(self) -> None:
        self._server.open()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watchdog_loop, name="FileTimerServer", daemon=self._daemon
        )
        self._thread.start()
        log.info("FileTimerServer for run %s reads %s", self._run_id, self._file_path)

    def _watchdog_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._run_watchdog()
            except Exception:  # the watchdog must outlive any one bad round
                log.exception("timer watchdog round failed")
                self._stop.wait(self._max_interval)

    def _run_watchdog(self) -> None:
        self._server.run_once(self._max_interval)
        self._last_progress_time = int(time.time())

    def _join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def run_once(self) -> None:
        """Ends the watchdog thread (if any) after its round, then handles whatever is in
        the pipe and reaps once more."""
        self._join()
        self._server.run_once(0.0)
        self._last_progress_time = int(time.time())

    def stop(self) -> None:
        self._join()
        self._server.stop(remove=True)

    def get_last_progress_time(self) -> int:
        return self._last_progress_time

    def _on_expired(self, timer: ExpiredTimer) -> None:
        log_debug_info_for_expired_timers(self._run_id, {timer.pid: [timer.scope_id]})
        log.info(
            "reaping worker pid %d with signal %d: timer %r expired",
            timer.pid,
            timer.signal,
            timer.scope_id,
        )
        self._reap_worker(timer.pid, timer.signal)

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        """Sends `signal` to the worker; never to the server itself, pid 1 or a group."""
        return procs.signal_pid(worker_pid, signal)

    @staticmethod
    def is_process_running(pid: int) -> bool:
        return procs.is_alive(pid)
