"""Pins: a node keeps its own ranks' snapshot at the step of the replicas it holds.

A node that loses a peer resumes, with the spare that takes the peer's ranks, from the
newest step every rank can load. The spare can load only what the survivors held of the
lost ranks: their replica, at step R. The survivors' own segments keep their two newest
snapshots, so a replica that lags by two snapshots or more (a slow stream, a busy host)
shares no step with them, and the job would fall back to disk. So when a replica at step
R is committed here, this node copies its own ranks' snapshot of step R (still in their
segments then: a replica is only committed while its sender's slot was unchanged) into a
pin segment per local rank, ``pinned_<local rank>.snap``. Workers find pins like any
segment of the folder, and the resume agreement counts their steps: a lagging replica
then costs the steps since R, never a fall back to an older step on disk.

A pin follows the replicas forward; when the job went back (a replica or a local
snapshot of an older step than the pin), the pin is dropped: it belongs to a past the
job left. Each pin reserves one slot (not two): the second slot of its file is a hole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas.segments import SegmentFile, allocate_segment

logger = logging.getLogger(__name__)

PIN_PREFIX = "pinned_"
# Copied in pieces with os.pwrite, which leaves the GIL to the launcher's other threads.
_CHUNK = 16 << 20


def pin_name(local_rank: int) -> str:
    return f"{PIN_PREFIX}{local_rank}{rl.SEGMENT_SUFFIX}"


@dataclass(frozen=True)
class PinPlan:
    copy_slot: int | None = None  # copy this local slot into the pin
    drop: bool = False  # invalidate the pin


def plan_pin(pinned: int | None, local: list[tuple[int, int]], replica_step: int) -> PinPlan:
    """What to do with a pin at step ``pinned`` when a replica of ``replica_step`` is
    committed, given the local segment's committed ``(slot, step)`` of the same world."""
    if pinned == replica_step:
        return PinPlan()
    for slot, step in local:
        if step == replica_step:
            return PinPlan(copy_slot=slot)
    # The job went back to an older step: a newer pin is not its future.
    return PinPlan(drop=pinned is not None and pinned > replica_step)


def pin_is_stale(pinned: int | None, local_newest: int | None) -> bool:
    """A pin newer than the local rank's newest snapshot: the job went back since."""
    return pinned is not None and local_newest is not None and pinned > local_newest


class Pins:
    """One pin segment per local rank, in the node's snapshot folder."""

    def __init__(self, folder: Path, slot_bytes: int, nproc: int) -> None:
        """Raises ``NoRoom`` (one line) when there is no memory for them."""
        self.folder = folder
        self._lock = threading.Lock()
        self._pins: list[tuple[SegmentFile, int]] = []
        size = rl.segment_bytes(slot_bytes)
        book = rl.slot_stride(slot_bytes)
        try:
            for lr in range(nproc):
                path = folder / pin_name(lr)
                allocate_segment(path, size, book=book)
                seg = SegmentFile(path, writable=True)
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                self._pins.append((seg, fd))
        except BaseException:
            self.close()
            raise
        # Only the booked slot: faulting the hole in would allocate it.
        threading.Thread(
            target=self._populate, args=(book,), name="stalwart-pin-populate", daemon=True
        ).start()

    def _populate(self, length: int) -> None:
        for seg, _ in list(self._pins):
            seg.populate(length)

    def _local(self, lr: int) -> SegmentFile | None:
        try:
            return SegmentFile(self.folder / rl.segment_name(lr), writable=False)
        except (OSError, ValueError):
            return None

    def follow(self, replica_step: int, world_size: int) -> None:
        """A replica of ``replica_step`` was committed here: pin the local ranks' own."""
        with self._lock:
            for lr, (pin, fd) in enumerate(self._pins):
                local = self._local(lr)
                if local is None:
                    continue
                try:
                    held = [(s, r) for s, r in local.records() if r.world_size == world_size]
                    pinned = pin.record(0)
                    plan = plan_pin(
                        pinned.step
                        if pinned is not None and pinned.world_size == world_size
                        else None,
                        [(s, r.step) for s, r in held],
                        replica_step,
                    )
                    if plan.drop:
                        pin.invalidate(0)
                    if plan.copy_slot is not None:
                        rec = dict(held)[plan.copy_slot]
                        self._copy(local, plan.copy_slot, rec, pin, fd)
                finally:
                    local.close()

    @staticmethod
    def _copy(
        local: SegmentFile, slot: int, rec: rl.CommitRecord, pin: SegmentFile, fd: int
    ) -> None:
        pin.invalidate(0)
        base = rl.data_offset(0, pin.slot_bytes)
        for offset, length in ((0, rec.skeleton_bytes), (rec.tensor_offset, rec.tensor_bytes)):
            done = 0
            while done < length:
                n = min(_CHUNK, length - done)
                with local.region(slot, offset + done, n) as view:
                    os.pwrite(fd, view, base + offset + done)
                done += n
        # A worker invalidates a slot's header before it overwrites it: an unchanged
        # header means the copy is whole (and a reader checks the checksums anyway).
        if local.record(slot) == rec:
            pin.commit(0, rec)
        else:
            logger.debug("local rank's step %d changed while it was pinned", rec.step)

    def drop_stale(self) -> None:
        """Drop the pins of local ranks that went back to an older step."""
        with self._lock:
            for lr, (pin, _) in enumerate(self._pins):
                pinned = pin.record(0)
                if pinned is None:
                    continue
                local = self._local(lr)
                if local is None:
                    continue
                try:
                    newest = max((r.step for _, r in local.records()), default=None)
                finally:
                    local.close()
                if pin_is_stale(pinned.step, newest):
                    pin.invalidate(0)

    def steps(self) -> list[int | None]:
        """The step each local rank's pin holds (for tests and the report)."""
        with self._lock:
            return [None if (r := pin.record(0)) is None else r.step for pin, _ in self._pins]

    def close(self) -> None:
        with self._lock:
            pins, self._pins = self._pins, []
        for seg, fd in pins:
            seg.close()
            with contextlib.suppress(OSError):
                os.close(fd)
