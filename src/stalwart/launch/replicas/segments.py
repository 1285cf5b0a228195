"""Snapshot segments as the launcher sees them (no torch), and the replicas of peers'
ranks a node holds in its snapshot folder."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil
import xxhash

from stalwart.base.events import Event
from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas import wire
from stalwart.launch.replicas.snapshots import reserve

logger = logging.getLogger(__name__)

REPLICA_NO_ROOM = Event.REPLICA_NO_ROOM
REPLICA_PREFIX = "replica_r"
# Reserved segments not yet holding a rank: no SEGMENT_SUFFIX, so workers never map them.
FREE_PREFIX = "free_replica_"
# A push of a rank whose replica is being written already is refused after this long.
_BUSY_WAIT_S = 2.0
# Linux >= 5.14: fault pages in writable without writing them.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

Emit = Callable[..., Any]


class SegmentFile:
    """A snapshot segment mapped by the launcher: a worker's, or a replica."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = path
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            self.slot_bytes = rl.slot_capacity(size)
            problem = rl.segment_problem(size)
            if problem:
                raise ValueError(f"{path}: {problem}")
            self.size = size
            length = rl.GENERATIONS * rl.slot_stride(self.slot_bytes)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)

    def record(self, slot: int) -> rl.CommitRecord | None:
        return rl.slot_record(self._map, slot, self.slot_bytes)

    def records(self) -> list[tuple[int, rl.CommitRecord]]:
        """Committed slots, newest (highest seq) first."""
        return rl.committed_slots(self._map, self.slot_bytes)

    def unchanged(self) -> bool:
        """Whether the file still has the size it was mapped at: reading a mapping past
        a file's end is a SIGBUS, which would end the launcher."""
        try:
            return os.stat(self.path, follow_symlinks=False).st_size == self.size
        except OSError:
            return False

    def newest_of(self, rank: int, world_size: int) -> tuple[int, rl.CommitRecord] | None:
        mine = [(s, r) for s, r in self.records() if r.rank == rank and r.world_size == world_size]
        return max(mine, key=lambda sr: (sr[1].step, sr[1].seq), default=None)

    def region(self, slot: int, offset: int, length: int) -> memoryview:
        start = rl.data_offset(slot, self.slot_bytes) + offset
        return memoryview(self._map)[start : start + length]

    def populate(self, length: int | None = None) -> None:
        """Fill this mapping's page tables now rather than one fault per page later
        (the first ``length`` bytes only, when given: the rest may be a hole)."""
        try:
            if length is None:
                self._map.madvise(_MADV_POPULATE_WRITE)
            else:
                self._map.madvise(_MADV_POPULATE_WRITE, 0, length)
        except (OSError, ValueError) as exc:
            logger.debug("could not pre-fault %s: %s", self.path, exc)

    def invalidate(self, slot: int) -> None:
        at = rl.header_offset(slot, self.slot_bytes)
        self._map[at : at + rl.PREFIX_BYTES] = rl.EMPTY_PREFIX

    def commit(self, slot: int, record: rl.CommitRecord) -> None:
        prefix, body = rl.split_header(record)
        at = rl.header_offset(slot, self.slot_bytes)
        self._map[at + rl.PREFIX_BYTES : at + rl.PREFIX_BYTES + len(body)] = body
        self._map[at : at + rl.PREFIX_BYTES] = prefix  # the commit, last

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._map.close()


def send_slot(sock: socket.socket, seg: SegmentFile, slot: int, rec: rl.CommitRecord) -> bool:
    """Send a slot's bytes; True when its commit record was unchanged after the read."""
    with seg.region(slot, 0, rec.skeleton_bytes) as view:
        sock.sendall(view)
    with seg.region(slot, rec.tensor_offset, rec.tensor_bytes) as view:
        sock.sendall(view)
    # A worker invalidates the header before it overwrites a slot: unchanged header,
    # unchanged bytes (the receiver's checksums catch the rest).
    return seg.record(slot) == rec


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class NoRoom(Exception):
    """No memory for a replica segment; the message is one line."""


def allocate_segment(path: Path, size: int, *, book: int | None = None) -> None:
    """Create a segment file of ``size`` bytes at ``path``, its first ``book`` bytes (all
    by default) reserved now; the rest stays a hole that takes no memory until written.
    Raises ``NoRoom`` (one line) when the folder or the host lacks the memory."""
    booked = size if book is None else min(book, size)
    folder = path.parent
    try:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
    except OSError as exc:
        raise NoRoom(f"cannot use {folder}: {exc.strerror}") from None
    memory = psutil.virtual_memory().available
    if booked > min(free, memory):
        where = f"{folder} has {_mib(free)}" if free < memory else f"{_mib(memory)} is"
        raise NoRoom(f"needs {_mib(booked)} but {where} free")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        no_room = reserve(fd, booked)
        if no_room is not None:
            raise NoRoom(f"cannot reserve {_mib(booked)} in {folder} ({no_room})")
        if booked < size:
            os.ftruncate(fd, size)
        # Named only once whole: a worker never maps a half-reserved segment.
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


class ReplicaHolder:
    """This node's replicas of other nodes' ranks, in its snapshot folder."""

    def __init__(
        self,
        folder: Path,
        slot_bytes: int,
        emit: Emit,
        *,
        reserve: int = 0,
        on_commit: Callable[[rl.CommitRecord], None] | None = None,
    ) -> None:
        """``reserve``: segments to allocate now, so that taking a rank's first replica
        (a spare's fetch after a node loss included) does not wait for the allocation,
        and a host without the memory says so at start-up. ``on_commit``: called with
        each replica's record once it is committed (the pins follow it)."""
        self.on_commit = on_commit
        self.folder = folder
        self.slot_bytes = slot_bytes
        self.segment_bytes = rl.segment_bytes(slot_bytes)
        self._emit = emit
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()
        self._no_room_told: set[int] = set()
        self._open: dict[int, SegmentFile] = {}
        self._free: list[SegmentFile] = []
        for i in range(reserve):
            path = folder / f"{FREE_PREFIX}{i}"
            try:
                self._allocate(path)
            except NoRoom as exc:
                error = (
                    f"no room to reserve {reserve} replica segment(s) of "
                    f"{_mib(self.segment_bytes)} ({exc}); replicas of peers' snapshots may "
                    "be refused"
                )
                logger.warning("%s", error)
                self._emit(REPLICA_NO_ROOM, rank=None, error=error)
                break
            self._free.append(SegmentFile(path, writable=True))
        self._populating: threading.Thread | None = None
        if self._free:
            # Filling the page tables of a fresh mapping costs about as much as receiving
            # into it (0.3 s of 0.5 s for 64 MiB, measured): done now, off the path of a
            # restart's fetch. madvise releases the GIL.
            self._populating = threading.Thread(
                target=self._populate,
                args=(tuple(self._free),),
                name="stalwart-replica-populate",
                daemon=True,
            )
            self._populating.start()

    @staticmethod
    def _populate(segs: tuple[SegmentFile, ...]) -> None:
        for seg in segs:
            seg.populate()

    def lock(self, rank: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(rank, threading.Lock())

    def path_of(self, rank: int) -> Path:
        return self.folder / f"{REPLICA_PREFIX}{rank}{rl.SEGMENT_SUFFIX}"

    def _segment(self, rank: int) -> SegmentFile:
        """The rank's replica segment, mapped once and kept (under the rank's lock)."""
        seg = self._open.get(rank)
        if seg is not None and not seg.unchanged():
            # Cut short or replaced under us: writing past its end would be a SIGBUS.
            logger.warning("replica segment %s changed size; making it anew", seg.path)
            del self._open[rank]
            seg.close()
            seg.path.unlink(missing_ok=True)
            seg = None
        if seg is None:
            path = self.path_of(rank)
            with self._guard:
                free = self._free.pop() if self._free and not path.exists() else None
            if free is not None:
                os.rename(free.path, path)  # the mapping stays valid
                free.path = path
                seg = free
            else:
                if not path.exists():
                    self._allocate(path)
                seg = SegmentFile(path, writable=True)
            self._open[rank] = seg
        return seg

    def close(self) -> None:
        busy = self._populating is not None and self._populating.is_alive()
        with self._guard:
            # Still being populated: those mappings go with the process, not under it.
            segs = [*self._open.values(), *([] if busy else self._free)]
            self._open.clear()
            self._free.clear()
        for seg in segs:
            seg.close()

    def _allocate(self, path: Path) -> None:
        allocate_segment(path, self.segment_bytes)

    def receive(
        self,
        sock: socket.socket,
        manifest: wire.Manifest,
        *,
        announce: bool,
        deadline: float | None = None,
    ) -> wire.Reply:
        """Take a snapshot off the stream into the slot that is not the newest.

        ``announce``: a push, whose sender waits for a go-ahead (or a refusal) before it
        sends the bytes and for the verdict after; a fetch has neither. ``deadline``
        (``time.monotonic()``): when all of it must have arrived. Another copy of the
        same rank under way is a refusal after ``_BUSY_WAIT_S``, not a wait for it."""
        rec = manifest.record

        def answer(reply: wire.Reply) -> wire.Reply:
            if announce:
                wire.send_frame(sock, reply)
            return reply

        try:
            skel, tensors = wire.payload_sizes(rec, self.slot_bytes)
        except wire.WireError as exc:
            return answer(wire.Reply(False, str(exc)))
        lock = self.lock(rec.rank)
        if not lock.acquire(timeout=_BUSY_WAIT_S):
            return answer(wire.Reply(False, f"busy: another copy of rank {rec.rank} under way"))
        try:
            try:
                seg = self._segment(rec.rank)
            except NoRoom as exc:
                error = f"no room for a replica of rank {rec.rank}: {exc}"
                if rec.rank not in self._no_room_told:  # once per rank, not per snapshot
                    self._no_room_told.add(rec.rank)
                    logger.warning("%s", error)
                    self._emit(REPLICA_NO_ROOM, rank=rec.rank, error=error)
                return answer(wire.Reply(False, error))
            answer(wire.Reply(True))  # go ahead
            return answer(self._fill(sock, seg, rec, skel, tensors, deadline))
        finally:
            lock.release()

    def _fill(
        self,
        sock: socket.socket,
        seg: SegmentFile,
        rec: rl.CommitRecord,
        skel: int,
        tensors: int,
        deadline: float | None,
    ) -> wire.Reply:
        held = seg.records()
        slot = 0 if not held else 1 - held[0][0]
        seg.invalidate(slot)
        with seg.region(slot, 0, skel) as view:
            wire.recv_exact(sock, view, deadline)
            skeleton_hash = xxhash.xxh3_64_intdigest(view)
        with seg.region(slot, rec.tensor_offset, tensors) as view:
            wire.recv_exact(sock, view, deadline)
            tensor_hash = xxhash.xxh3_64_intdigest(view)
        end = wire.expect(sock, wire.End, deadline)
        assert isinstance(end, wire.End)
        if not end.ok:
            return wire.Reply(False, "the source snapshot changed while it was sent")
        if (skeleton_hash, tensor_hash) != (rec.skeleton_hash, rec.tensor_hash):
            return wire.Reply(False, f"rank {rec.rank} step {rec.step}: checksum differs")
        seq = held[0][1].seq + 1 if held else 1
        seg.commit(slot, msgspec.structs.replace(rec, seq=seq))
        for other, old in held:
            if other != slot and old.step > rec.step:
                # The job went back to an older step: the newer replica is not its future.
                seg.invalidate(other)
        self._no_room_told.discard(rec.rank)
        if self.on_commit is not None:
            try:
                self.on_commit(rec)
            except Exception:  # the replica stands; the pin is an extra
                logger.exception("could not pin the step of rank %d's replica", rec.rank)
        return wire.Reply(True)

    def newest(self, rank: int, world_size: int) -> tuple[SegmentFile, int, rl.CommitRecord] | None:
        """The newest committed snapshot of a rank in this folder, local or replica."""
        best: tuple[SegmentFile, int, rl.CommitRecord] | None = None
        for path in sorted(self.folder.glob(f"*{rl.SEGMENT_SUFFIX}")):
            try:
                seg = SegmentFile(path, writable=False)
            except (OSError, ValueError):
                continue
            got = seg.newest_of(rank, world_size)
            if got is not None and (
                best is None or (got[1].step, got[1].seq) > (best[2].step, best[2].seq)
            ):
                if best is not None:
                    best[0].close()
                best = (seg, got[0], got[1])
            else:
                seg.close()
        return best


def newest_replica(folder: Path, rank: int) -> tuple[int, str] | None:
    """(step, kind) of the newest replica of *rank* committed in *folder*, or None
    (for tests and benchmarks that wait for a replica to land)."""
    try:
        seg = SegmentFile(folder / f"{REPLICA_PREFIX}{rank}{rl.SEGMENT_SUFFIX}", writable=False)
    except (OSError, ValueError):
        return None
    try:
        held = seg.records()
        return (held[0][1].step, held[0][1].kind) if held else None
    finally:
        seg.close()


def replica_ranks(folder: Path) -> list[int]:
    """Ranks this folder holds replicas of (for tests and the report)."""
    out = []
    for p in folder.glob(f"{REPLICA_PREFIX}*{rl.SEGMENT_SUFFIX}"):
        with contextlib.suppress(ValueError):
            out.append(int(p.name[len(REPLICA_PREFIX) : -len(rl.SEGMENT_SUFFIX)]))
    return sorted(out)
