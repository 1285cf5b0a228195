"""Worker side of named-pipe timers: ``with expires(after=5, scope="step"): ...``.

The node's timer server kills the calling process if the block is still running when
the timer expires. The pipe is found through STALWART_TIMER_FILE or, as with torch
elastic, TORCHELASTIC_TIMER_FILE. Without either, `expires` warns once and does nothing
(or raises when STALWART_MONITOR_STRICT=1), so scripts also run outside a launcher.
Kept import-light: the package root re-exports this module as ``stalwart.timer``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator

from stalwart.monitor import envvars
from stalwart.monitor.pipe import PipeError, PipeWriter
from stalwart.monitor.wire import TimerMessage, check_signal, encode

log = logging.getLogger(__name__)

__all__ = ["PipeError", "TimerClient", "TimerUnavailableError", "expires", "timer_file_from_env"]


class TimerUnavailableError(RuntimeError):
    """No timer server was configured for this process."""


def timer_file_from_env() -> str | None:
    return os.environ.get(envvars.TIMER_FILE) or os.environ.get(envvars.TORCHELASTIC_TIMER_FILE)


class TimerClient:
    """Sends acquire/release requests for this process to the node's timer server.

    `sig` is what reaps this process when a timer expires: SIGKILL by default, as with
    torch's FileTimerClient; a signal <= 0 only reports the expiry and never reaps.
    A number that is no signal of this system is refused here with ValueError.
    """

    def __init__(self, path: str, sig: int = signal.SIGKILL, keep_open: bool = True) -> None:
        self.path = path
        self.signal = check_signal(int(sig))
        self._writer = PipeWriter(path, keep_open=keep_open)

    def acquire(self, scope_id: str, expiration_time: float, sig: int | None = None) -> None:
        """Arms a timer that expires at wall-clock `expiration_time`."""
        self._send(scope_id, expiration_time, self.signal if sig is None else check_signal(sig))

    def release(self, scope_id: str) -> None:
        self._send(scope_id, -1.0, 0)

    def _send(self, scope_id: str, expiration_time: float, sig: int) -> None:
        line = encode(TimerMessage(os.getpid(), scope_id, expiration_time, sig))
        self._writer.write(line)

    def close(self) -> None:
        self._writer.close()


_default: TimerClient | None = None
_warned = False


def _default_client() -> TimerClient | None:
    global _default, _warned
    path = timer_file_from_env()
    if path is None:
        if os.environ.get(envvars.STRICT) == "1":
            raise TimerUnavailableError(
                f"stalwart timer: neither {envvars.TIMER_FILE} nor "
                f"{envvars.TORCHELASTIC_TIMER_FILE} is set; run under `stalwart run`"
            )
        if not _warned:
            _warned = True
            log.warning(
                "stalwart timer: no timer server configured (%s unset); timers are not enforced",
                envvars.TIMER_FILE,
            )
        return None
    if _default is None or _default.path != path:
        # Only stalwart's server reads a pipe that stays open; torch's needs open-write-close.
        _default = TimerClient(path, keep_open=bool(os.environ.get(envvars.TIMER_FILE)))
    return _default


@contextlib.contextmanager
def expires(
    after: float,
    scope: str | None = None,
    client: TimerClient | None = None,
    sig: int | None = None,
) -> Iterator[None]:
    """Kills this process (stacks first, then `sig`) if the block runs longer than `after` s.

    `scope` names the timer in reports; it defaults to the caller's file:line. `sig`
    defaults to the client's (SIGKILL); a signal <= 0 only reports the expiry.
    """
    if not after > 0 or after == float("inf"):
        raise ValueError(
            f"expires(after=...) must be a finite number of seconds > 0, got {after!r}"
        )
    if sig is not None:
        check_signal(sig)
    if client is None:
        client = _default_client()
    if client is None:
        yield
        return
    if scope is None:
        frame = sys._getframe(2)
        scope = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    client.acquire(scope, time.time() + after, sig)
    try:
        yield
    finally:
        client.release(scope)
