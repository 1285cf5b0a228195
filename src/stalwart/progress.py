"""Training progress, reported by workers for the launcher's goodput accounting.

A worker calls ``report(step)`` once per step (``stalwart.inject.step``, the monitor
client and the framework callbacks do it for it).  Under ``stalwart run`` that is two
plain stores into a shared-memory slot of the launcher's (the step and the monotonic
time it was reached): no syscall, well under a microsecond.  The launcher samples the
slots and writes ``progress`` events at a bounded rate.  Without the launcher's
variables, ``report`` costs one attribute check.

Slot layout (native byte order): ``first_step`` int64 and ``first_at`` float64 (the
first step this process reported and when), then ``step`` int64 and ``at`` float64 (the
latest).  Step -1 means none yet; times are ``time.monotonic()``, which is system-wide
(CLOCK_MONOTONIC), so the launcher compares them with its own clock.  The first pair
tells the launcher exactly where a restarted attempt resumed, however coarse its sampling.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

#: Path of the launcher's progress segment and this worker's slot index in it.
SHM_ENV = "STALWART_PROGRESS_SHM"
SLOT_ENV = "STALWART_PROGRESS_SLOT"

_PAIR = struct.Struct("=qd")
#: The latest pair alone, at offset ``_PAIR.size`` of a slot.
LATEST = _PAIR
LATEST_OFFSET = _PAIR.size
SLOT_SIZE = 2 * _PAIR.size


@dataclass(frozen=True)
class Sample:
    """The first and the last step a rank reported, and when (monotonic clock)."""

    first_step: int
    first_at: float
    step: int
    at: float


class _Writer:
    __slots__ = ("buf", "fresh", "offset")

    def __init__(self, buf: mmap.mmap | None, offset: int) -> None:
        self.buf = buf
        self.offset = offset
        self.fresh = True


def _open_writer() -> _Writer:
    path = os.environ.get(SHM_ENV)
    slot = os.environ.get(SLOT_ENV)
    if not path or slot is None:
        return _Writer(None, 0)
    try:
        index = int(slot)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except (OSError, ValueError):
        return _Writer(None, 0)
    try:
        size = os.fstat(fd).st_size
        if index < 0 or (index + 1) * SLOT_SIZE > size:
            return _Writer(None, 0)
        return _Writer(mmap.mmap(fd, size), index * SLOT_SIZE)
    finally:
        os.close(fd)


_writer: _Writer | None = None


class Claims:
    """Which signals the program gives itself; the optimizer-step hook of
    `stalwart.autostep` leaves those to it (read on its hot path: plain attributes)."""

    __slots__ = ("heartbeats", "steps")

    def __init__(self) -> None:
        self.steps = False  # the program reported a step
        self.heartbeats = False  # a monitoring client owns the heartbeat slot


claims = Claims()


def report(step: int) -> None:
    """Records that this rank reached training step *step* (call once per step)."""
    claims.steps = True
    record(step)


def claim_heartbeats() -> None:
    """A monitoring client owns this rank's heartbeat slot from now on."""
    claims.heartbeats = True


def slot() -> tuple[mmap.mmap, int] | None:
    """This process's (mapping, offset) of its progress slot, or None outside a launcher."""
    global _writer
    w = _writer
    if w is None:
        w = _writer = _open_writer()
    return (w.buf, w.offset) if w.buf is not None else None


def record(step: int) -> None:
    """`report` without taking the signal over (the automatic step signal's path)."""
    global _writer
    w = _writer
    if w is None:
        w = _writer = _open_writer()
    if w.buf is not None:
        now = time.monotonic()
        if w.fresh:
            w.fresh = False
            _PAIR.pack_into(w.buf, w.offset, step, now)
        _PAIR.pack_into(w.buf, w.offset + _PAIR.size, step, now)


def reset() -> None:
    """Forgets the cached slot and who reports steps (after a fork into another rank,
    and in tests)."""
    global _writer
    _writer = None
    claims.steps = claims.heartbeats = False


class ProgressBoard:
    """The launcher's side: one slot per local rank in a private file it owns."""

    def __init__(self, folder: Path, nslots: int) -> None:
        self.path = folder / "progress"
        self.nslots = nslots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, nslots * SLOT_SIZE)
            self._mm = mmap.mmap(fd, nslots * SLOT_SIZE)
        finally:
            os.close(fd)
        self.clear()

    def clear(self) -> None:
        """Empties every slot (a new attempt starts with no progress)."""
        for i in range(self.nslots):
            _PAIR.pack_into(self._mm, i * SLOT_SIZE, -1, 0.0)
            _PAIR.pack_into(self._mm, i * SLOT_SIZE + _PAIR.size, -1, 0.0)

    def worker_env(self, local_rank: int) -> dict[str, str]:
        return {SHM_ENV: str(self.path), SLOT_ENV: str(local_rank)}

    def read(self) -> dict[int, Sample]:
        """local rank -> last sample, for ranks that reported at least one step."""
        out: dict[int, Sample] = {}
        for i in range(self.nslots):
            first, first_at = _PAIR.unpack_from(self._mm, i * SLOT_SIZE)
            step, at = _PAIR.unpack_from(self._mm, i * SLOT_SIZE + _PAIR.size)
            if first >= 0 and step >= 0:
                out[i] = Sample(int(first), float(first_at), int(step), float(at))
        return out

    def close(self) -> None:
        self._mm.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
