"""Progress timestamps shared with the monitor process, and the periodic threads.

The clock is a 32-byte file mapped into memory (in /dev/shm when it exists) so
the monitor process can read it even while this interpreter is stuck with the
GIL held.  Layout (little-endian doubles): automatic tick, last ``ping()``,
manual mode armed (1.0/0.0), closed flag.  All times are ``time.monotonic()``,
which is system-wide on Linux.

Two ``Periodic`` threads refresh the automatic tick and this rank's store
heartbeat every ``interval``; both stop when the GIL is held for good, which is
exactly what the hard timeout and the peers' heartbeat checks detect.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

LAYOUT = struct.Struct("<dddd")
AUTO, MANUAL, ARMED, CLOSED = range(4)


class ProgressClock:
    """Owner side of the shared progress timestamps."""

    def __init__(self) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="stalwart-progress-", dir=folder)
        try:
            os.ftruncate(fd, LAYOUT.size)
            self._map = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
        now = time.monotonic()
        self._closed = False
        self._values = [now, now, 0.0, 0.0]
        self._flush()

    def _flush(self) -> None:
        try:
            LAYOUT.pack_into(self._map, 0, *self._values)
        except (ValueError, TypeError):
            # The tick thread may beat once more while close() unmaps: nothing to record.
            if not self._closed:
                raise

    def tick(self) -> None:
        self._values[AUTO] = time.monotonic()
        self._flush()

    def ping(self) -> None:
        now = time.monotonic()
        self._values[MANUAL] = now
        self._values[AUTO] = now
        self._values[ARMED] = 1.0
        self._flush()

    def disarm(self) -> None:
        """Leave manual mode: wrapper phases (barriers, hooks) are not user progress."""
        self._values[ARMED] = 0.0
        self._values[AUTO] = time.monotonic()
        self._flush()

    def manual_age(self) -> float | None:
        """Seconds since the last ``ping()``, or None when not armed."""
        if not self._values[ARMED]:
            return None
        return time.monotonic() - self._values[MANUAL]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._values[CLOSED] = 1.0
        with contextlib.suppress(ValueError):
            self._flush()
            self._map.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Periodic(threading.Thread):
    """Background thread calling ``action`` every ``interval`` seconds.

    The progress tick and the store heartbeat run on separate instances, so a
    heartbeat stuck on a slow or vanished store never stops the tick that tells
    the monitor process this interpreter is alive.
    """

    def __init__(self, name: str, action: Callable[[], None], interval: float) -> None:
        super().__init__(name=f"stalwart-inprocess-{name}", daemon=True)
        self.action = action
        self.interval = interval
        self._stop_event = threading.Event()
        self._failures = 0

    def beat(self) -> None:
        try:
            self.action()
            self._failures = 0
        except Exception as exc:  # the store host may be gone; keep trying
            self._failures += 1
            if self._failures in (1, 10, 100):
                log.warning("%s failed (%d times): %s", self.name, self._failures, exc)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            # Bounded: a call stuck on an unreachable store must not hold the
            # exit; the thread is a daemon.
            self.join(timeout=max(5.0, 2 * self.interval))
