"""Liveness from heartbeat counters: a party is alive while the counter it keeps moving
moves.  Used by the elastic rendezvous (one counter per node) and by the in-process
wrapper (one per rank).

Only changes of a counter are looked at, each timed on this machine's monotonic clock, so
no clocks are ever compared across hosts and a counter's value means nothing beyond
"different from last time".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class CounterWatch(Generic[K]):
    """Which parties' counters stood still for longer than ``lost_after`` seconds.

    A counter read as None (its key is gone, say an expired etcd lease) counts as lost at
    the next look rather than after ``lost_after``.

    blind_after: when the observer itself did not look for this long (it was blocked, or
    its reads stalled), silence it did not watch is no evidence, and every party's quiet
    starts afresh at the next look.  None: never.

    Times are ``time.monotonic()`` unless given (``now``, for tests); safe to share
    between threads.
    """

    def __init__(
        self, lost_after: float, *, blind_after: float | None = None, now: float | None = None
    ) -> None:
        self.lost_after = lost_after
        self._blind_after = blind_after
        self._seen: dict[K, tuple[object, float]] = {}
        self._last_look = time.monotonic() if now is None else now
        self._lock = threading.Lock()

    def observe_many(self, readings: Iterable[tuple[K, object]], now: float | None = None) -> None:
        """Records counters read together (one look).  Pass the time *after* the read: a
        slow read must not age the counters it returned."""
        t = time.monotonic() if now is None else now
        with self._lock:
            if self._blind_after is not None and t - self._last_look > self._blind_after:
                self._seen = {k: (v, t) for k, (v, _) in self._seen.items()}
            self._last_look = t
            for key, value in readings:
                old = self._seen.get(key)
                if old is None or old[0] != value:
                    self._seen[key] = (value, t)

    def observe(self, key: K, value: object, now: float | None = None) -> None:
        self.observe_many([(key, value)], now)

    def lost(self, key: K, now: float | None = None) -> float | None:
        """Seconds since *key*'s counter last changed, if that makes it lost; None while
        it is alive or was never observed."""
        t = time.monotonic() if now is None else now
        with self._lock:
            seen = self._seen.get(key)
        if seen is None:
            return None
        silent = t - seen[1]
        if (seen[0] is None and silent > 0) or silent > self.lost_after:
            return silent
        return None

    def stale(self, key: K, value: object, now: float | None = None) -> bool:
        """Observes one counter and tells whether it is lost."""
        t = time.monotonic() if now is None else now
        self.observe(key, value, t)
        return self.lost(key, t) is not None
