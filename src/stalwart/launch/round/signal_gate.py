"""How the supervisor takes a termination signal: one small part that owns the handlers
and the flags a handler reads (starting workers, stopping, a signal already seen).

The first signal raises `SignalReceived` where the main thread is; one arriving while
workers are being started waits until every pid is known; a second one while stopping
calls `on_second` (no more grace).  `stopping` is written here only.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from stalwart.launch.round import signals
from stalwart.launch.round.records import SignalReceived


class SignalGate:
    """The launcher's termination-signal handlers and their state."""

    def __init__(self, on_second: Callable[[], None]) -> None:
        self._on_second = on_second
        self._old: dict[int, Any] = {}
        self._defer = False
        self._deferred: int | None = None
        # The first signal the handler raised for; re-raised should anything have
        # swallowed the exception.
        self._seen: int | None = None
        self._stopping = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    def begin_stopping(self) -> None:
        """The job is being stopped: a further signal means "now", not "stop"."""
        self._stopping = True

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._defer:
            if self._deferred is None:
                self._deferred = signum
            return
        if self._stopping:
            self._on_second()
            return
        if self._seen is None:
            self._seen = signum
        raise SignalReceived(signum)

    def install(self, extra: Iterable[str]) -> None:
        """torchrun's four always (a worker must never be orphaned), plus those asked
        for; a signal held before this (`signals.hold`) is raised now."""
        asked = tuple(signal.Signals[name] for name in extra)
        for sig in dict.fromkeys((*signals.FORWARDED, *asked)):
            self._old[sig] = signal.signal(sig, self.on_signal)
        early = signals.pending()
        if early is not None:  # arrived while the launcher was still starting
            signals.clear()
            raise SignalReceived(early)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def raise_swallowed(self) -> None:
        """A signal whose exception something caught and dropped is acted on here."""
        if self._seen is not None and not self._stopping:
            raise SignalReceived(self._seen)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal arriving inside waits until the block is done (workers being started:
        one forked from the template runs before its pid comes back), then is raised."""
        self._deferred = None
        self._defer = True
        try:
            yield
        finally:
            self._defer = False
        if self._deferred is not None:
            raise SignalReceived(self._deferred)
