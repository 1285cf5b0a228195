"""The shared-memory segment the workers write their slots into, as the monitor reads it.

`Slots` owns the mapping: made fresh at start and for each attempt (nothing a worker
scribbled carries over), read slot by slot, closed at stop. It also owns the time floor
(no slot time is older than the segment) and the out-of-range fields already logged.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from pathlib import Path

from stalwart.base.events import Event
from stalwart.monitor import layout
from stalwart.monitor.layout import SlotSnapshot
from stalwart.monitor.node_state import SHM_NAME, LogEvent

log = logging.getLogger(__name__)


class Slots:
    """One segment per node monitor, at `path` (in its private run folder)."""

    def __init__(self, path: Path, nslots: int, emit: LogEvent) -> None:
        self.path = path
        self._nslots = nslots
        self._emit = emit
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        self._retired: list[mmap.mmap] = []
        self._floor = 0.0  # monotonic time the segment was made: no slot time is older
        self._bad_fields: set[tuple[int, str]] = set()  # (local rank, field) logged once

    @property
    def mapping(self) -> mmap.mmap | None:
        """The segment as of now; a reader keeps it for one scan (closed a rebuild later)."""
        return self._mm

    @property
    def floor(self) -> float:
        return self._floor

    def create(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # left by an earlier monitor of this run: never reuse
        with self._lock:
            self._mm = layout.create_segment(self.path, self._nslots)
            self._floor = time.monotonic()

    def rebuild(self) -> None:
        """Gives the next attempt a fresh segment (before its workers start): its
        leftover processes write into a file nobody reads."""
        with self._lock:
            if self._mm is None:
                return
            fresh = self.path.with_name(SHM_NAME + ".next")
            try:
                fresh.unlink(missing_ok=True)
                mm = layout.create_segment(fresh, self._nslots)
                os.replace(fresh, self.path)
            except OSError as exc:
                # E.g. a full tmpfs: reuse the mapping, rewriting what a worker may have
                # scribbled.
                log.warning(
                    "could not make a fresh monitor segment (%s); resetting it in place", exc
                )
                with contextlib.suppress(OSError):
                    fresh.unlink(missing_ok=True)
                layout.reset_segment(self._mm, self._nslots)
                self._floor = time.monotonic()
                self._bad_fields.clear()
                return
            # The scanner may still be reading the old mapping: close it one rebuild later.
            for old in self._retired:
                old.close()
            self._retired = [self._mm]
            self._mm = mm
            self._floor = time.monotonic()
            self._bad_fields.clear()

    def close(self) -> None:
        with self._lock:
            if self._mm is not None:
                self._mm.close()
                self._mm = None
            for old in self._retired:
                old.close()
            self._retired = []
        self.path.unlink(missing_ok=True)
        self.path.with_name(SHM_NAME + ".next").unlink(missing_ok=True)

    def read(self, local_rank: int) -> SlotSnapshot | None:
        """The slot as of now; None before start or after stop."""
        mm = self._mm
        return layout.read_slot(mm, local_rank) if mm is not None else None

    def note_bad_fields(self, local_rank: int, pid: int, fields: list[str]) -> None:
        """Logs each out-of-range field of a slot once per segment."""
        with self._lock:
            new = [f for f in fields if (local_rank, f) not in self._bad_fields]
            self._bad_fields.update((local_rank, f) for f in new)
        if not new:
            return
        log.warning(
            "rank %d (pid %d) slot holds out-of-range %s; ignored",
            local_rank,
            pid,
            ", ".join(new),
        )
        self._emit(Event.MONITOR_BAD_SLOT, {"local_rank": local_rank, "pid": pid, "fields": new})
