"""Snapshots in the memory the launcher owns: writing, finding and reading them.

The launcher (``stalwart run --ckpt-ram``) creates one segment file per local rank in a
private folder in ``/dev/shm`` and names the folder in ``STALWART_CKPT_RAM_DIR``. A
worker maps its segment and copies each snapshot into the slot that does not hold its
newest committed one; the commit record goes last (see ``ramlayout``). The segment lives
as long as the launcher, so a restarted worker, warm or cold, finds its snapshots there.

Reading copies the tensors out (a restored tensor must not alias memory a later save
overwrites), checks the checksums of what it copied from, and rebuilds the state with an
unpickler that, like ``torch.load(weights_only=True)``, accepts only containers, numbers,
strings, dtypes and tensors unless the caller passes ``weights_only=False``. The files are
0600 in a 0700 folder of this user, which :meth:`RamSegment.open` checks before mapping.
"""

from __future__ import annotations

import ctypes
import io
import logging
import mmap
import os
import pickle
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from stalwart.base import envvars
from stalwart.base.files import untrusted

from . import ramlayout as rl
from .errors import CheckpointCorruptError, CheckpointError
from .inplace import bind, same_memory
from .skeleton import SkeletonUnpickler
from .staging import StagingPlan, TensorRef, _run_copies, copy_planned, ref_view

logger = logging.getLogger(__name__)

_SPLIT_BYTES = 32 << 20
# Linux >= 5.14: fault pages in writable without writing them.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


_ADVISE_CHUNK = 8 << 20
# Hashing a slot in the background stops between chunks of this size when the segment is
# closed (a few milliseconds each).
_HASH_CHUNK = 32 << 20


def _advise(addr: int, length: int, advice: int, stop: threading.Event | None = None) -> None:
    """madvise(2) in chunks, through ctypes, which lets go of the GIL during the call.

    ``mmap.madvise`` holds the GIL throughout: pre-faulting a 1 GiB segment "in the
    background" stopped every other thread of the worker for 0.6 s (measured). And
    one call holds the process's memory-map lock while it faults: a thread start or
    a large allocation (which maps memory) waited for all of it; between chunks they
    get their turn.  ``stop``: checked between chunks (pre-faulting is only a head start,
    and whoever closes the segment must not wait for all of it).
    """
    end = addr + length
    while addr < end and not (stop is not None and stop.is_set()):
        n = min(_ADVISE_CHUNK, end - addr)
        if _libc.madvise(addr, n, advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        addr += n


class SnapshotTooLargeError(CheckpointError):
    """A snapshot does not fit the slot the launcher sized (``--ckpt-ram``)."""


def _check_private(st: os.stat_result, path: Path, *, folder: bool) -> None:
    problem = untrusted(st, "folder" if folder else "file", private=True)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")


class RamSegment:
    """One local rank's segment, mapped shared (writable or read-only)."""

    def __init__(self, path: Path, fd: int, writable: bool) -> None:
        self.path = path
        self._fd = fd
        try:
            size = os.fstat(fd).st_size
            self.slot_bytes = rl.slot_capacity(size)
            # A segment cut short (or grown) is damaged, not a smaller one: its second
            # slot's header would lie inside the first slot's data, or past the end.
            problem = rl.segment_problem(size)
            if problem:
                raise CheckpointCorruptError(f"{path}: {problem}")
            length = rl.GENERATIONS * rl.slot_stride(self.slot_bytes)
            if writable:
                self._map = mmap.mmap(fd, length, access=mmap.ACCESS_WRITE)
            else:
                self._map = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise CheckpointCorruptError(f"{path}: cannot map the segment: {exc}") from None
        except BaseException:
            os.close(fd)
            raise
        self._writable = writable
        # A uint8 view of the whole segment: tensors are copied to and from slices of
        # it, and its address is what madvise needs.
        with warnings.catch_warnings():
            # Read-only mappings are only read from: torch warns about any such buffer.
            warnings.simplefilter("ignore", UserWarning)
            self._bytes: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self._length = length
        self._populating: threading.Thread | None = None
        self._closing = threading.Event()
        # Slots whose tensor bytes this mapping hashed, by the record they were hashed
        # for: it committed them, or verified them (see verify).
        self._checked: dict[int, rl.CommitRecord] = {}
        self._prechecking: threading.Thread | None = None
        if writable and not self.records():
            # A fresh segment: nothing to restore, so fault its pages in for the
            # saves now. One holding snapshots is a restarted worker's, which reads
            # one of them first: pre-faulting for writes then would take a core and
            # the memory-map lock from that restore (see start_populating).
            self.start_populating()

    def start_populating(self) -> None:
        """Fault the writable mapping's pages in on a thread, once.

        The launcher allocated the pages; mapping them into this process still costs
        a fault per page (0.3-0.5 s per 100 MiB measured on a first save), so that is
        taken off the training thread.
        """
        if self._writable and self._populating is None:
            self._populating = threading.Thread(
                target=self._populate, name="stalwart-ram-populate", daemon=True
            )
            self._populating.start()

    def _populate(self) -> None:
        assert self._bytes is not None
        try:
            _advise(self._bytes.data_ptr(), self._length, _MADV_POPULATE_WRITE, self._closing)
        except OSError as exc:
            logger.debug("could not pre-fault the snapshot segment: %s", exc)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, writable: bool = True) -> RamSegment:
        """Map a segment after checking that only this user can have written it."""
        p = Path(path)
        _check_private(os.lstat(p.parent), p.parent, folder=True)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(p, flags)
        try:
            _check_private(os.fstat(fd), p, folder=False)
        except BaseException:
            os.close(fd)
            raise
        return cls(p, fd, writable)

    def maps(self, path: Path) -> bool:
        """Whether ``path`` is still the file this segment mapped (not replaced since)."""
        try:
            now, mine = os.stat(path), os.fstat(self._fd)
        except (OSError, ValueError):
            return False
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    # -- headers ---------------------------------------------------------------------
    def record(self, slot: int) -> rl.CommitRecord | None:
        return rl.slot_record(self._map, slot, self.slot_bytes)

    def records(self) -> list[tuple[int, rl.CommitRecord]]:
        """Committed slots, newest (highest seq) first."""
        return rl.committed_slots(self._map, self.slot_bytes)

    def _invalidate(self, slot: int) -> None:
        self._checked.pop(slot, None)
        at = rl.header_offset(slot, self.slot_bytes)
        self._map[at : at + rl.PREFIX_BYTES] = rl.EMPTY_PREFIX

    # -- write -----------------------------------------------------------------------
    def fits(self, staging: StagingPlan) -> bool:
        return rl.round_up(len(staging.skeleton), rl.PAGE) + staging.used_bytes <= self.slot_bytes

    def check_fits(self, staging: StagingPlan) -> None:
        """Raise SnapshotTooLargeError (one line) when ``staging`` does not fit a slot."""
        if not self.fits(staging):
            size = rl.round_up(len(staging.skeleton), rl.PAGE) + staging.used_bytes
            raise SnapshotTooLargeError(
                f"a snapshot of {size / 2**20:.1f} MiB does not fit the "
                f"{self.slot_bytes / 2**20:.1f} MiB the launcher reserved per rank (--ckpt-ram)"
            )

    def write(
        self, staging: StagingPlan, step: int, rank: int, world_size: int, threads: int = 1
    ) -> rl.CommitRecord:
        """Copy a planned snapshot into the older slot and commit it (record last)."""
        return self.commit(self.stage(staging, step, rank, world_size, threads))

    def _next_slot(self) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """(slot, seq, older) for the next snapshot: never the newest committed slot,
        which must survive a torn copy; that slot is invalidated here."""
        held = self.records()
        slot = 0 if not held else 1 - held[0][0] if rl.GENERATIONS == 2 else held[-1][0]
        self._invalidate(slot)
        seq = held[0][1].seq + 1 if held else 1
        return slot, seq, tuple((other, rec.step) for other, rec in held if other != slot)

    def stage(
        self, staging: StagingPlan, step: int, rank: int, world_size: int, threads: int = 1
    ) -> StagedSnapshot:
        """Copy a planned snapshot into the older slot, uncommitted.

        Once this returns the caller's tensors are no longer read; :meth:`commit` (which
        may run on another thread) hashes the slot and writes the record. Stage the next
        snapshot only after that commit: the slot choice reads the committed records.
        """
        assert self._writable and self._bytes is not None
        self.check_fits(staging)
        self.start_populating()
        skeleton = staging.skeleton
        tensor_offset = rl.round_up(len(skeleton), rl.PAGE)
        slot, seq, older = self._next_slot()
        base = rl.data_offset(slot, self.slot_bytes)
        self._map[base : base + len(skeleton)] = skeleton
        start = base + tensor_offset
        copy_planned(self._bytes[start : start + staging.used_bytes], staging, threads)
        return StagedSnapshot(
            slot=slot,
            step=step,
            rank=rank,
            world_size=world_size,
            seq=seq,
            skeleton_bytes=len(skeleton),
            tensor_offset=tensor_offset,
            tensor_bytes=staging.used_bytes,
            older=older,
        )

    def stage_raw(
        self, head: bytes, body_bytes: int, step: int, rank: int, world_size: int, kind: str
    ) -> tuple[StagedSnapshot, memoryview]:
        """Reserve the older slot for ``head`` plus ``body_bytes`` the caller fills in
        through the returned view (released before :meth:`commit`), uncommitted."""
        assert self._writable
        tensor_offset = rl.round_up(len(head), rl.PAGE)
        if tensor_offset + body_bytes > self.slot_bytes:
            raise SnapshotTooLargeError(
                f"a snapshot of {(tensor_offset + body_bytes) / 2**20:.1f} MiB does not fit "
                f"the {self.slot_bytes / 2**20:.1f} MiB the launcher reserved per rank "
                "(--ckpt-ram)"
            )
        self.start_populating()
        slot, seq, older = self._next_slot()
        base = rl.data_offset(slot, self.slot_bytes)
        self._map[base : base + len(head)] = head
        start = base + tensor_offset
        staged = StagedSnapshot(
            slot, step, rank, world_size, seq, len(head), tensor_offset, body_bytes, older, kind
        )
        return staged, memoryview(self._map)[start : start + body_bytes]

    def commit(self, staged: StagedSnapshot) -> rl.CommitRecord:
        """Hash a staged slot and write its commit record last."""
        base = rl.data_offset(staged.slot, self.slot_bytes)
        start = base + staged.tensor_offset
        with memoryview(self._map) as mv:
            skeleton_hash = xxhash.xxh3_64_intdigest(mv[base : base + staged.skeleton_bytes])
            tensor_hash = xxhash.xxh3_64_intdigest(mv[start : start + staged.tensor_bytes])
        record = rl.CommitRecord(
            format=rl.FORMAT,
            step=staged.step,
            rank=staged.rank,
            world_size=staged.world_size,
            seq=staged.seq,
            skeleton_bytes=staged.skeleton_bytes,
            skeleton_hash=skeleton_hash,
            tensor_offset=staged.tensor_offset,
            tensor_bytes=staged.tensor_bytes,
            tensor_hash=tensor_hash,
            created_unix=time.time(),
            kind=staged.kind,
        )
        prefix, body = rl.split_header(record)
        at = rl.header_offset(staged.slot, self.slot_bytes)
        self._map[at + rl.PREFIX_BYTES : at + rl.PREFIX_BYTES + len(body)] = body
        self._map[at : at + rl.PREFIX_BYTES] = prefix  # the commit
        self._checked[staged.slot] = record
        for other, step in staged.older:
            if step > staged.step:
                # The job went back to an older step: a newer snapshot left from before
                # is not what it resumes from now.
                self._invalidate(other)
        return record

    # -- read ------------------------------------------------------------------------
    def _check_bounds(self, slot: int, record: rl.CommitRecord) -> None:
        if (
            record.tensor_offset + record.tensor_bytes > self.slot_bytes
            or record.skeleton_bytes > record.tensor_offset
            or min(record.skeleton_bytes, record.tensor_offset, record.tensor_bytes) < 0
        ):
            raise CheckpointCorruptError(f"{self.path} slot {slot}: record exceeds the slot")

    def _skeleton(self, slot: int, record: rl.CommitRecord) -> bytes:
        base = rl.data_offset(slot, self.slot_bytes)
        skeleton = bytes(self._map[base : base + record.skeleton_bytes])
        if xxhash.xxh3_64_intdigest(skeleton) != record.skeleton_hash:
            raise CheckpointCorruptError(f"{self.path} slot {slot}: skeleton checksum differs")
        return skeleton

    def head(self, slot: int, record: rl.CommitRecord, limit: int) -> bytes:
        """A committed slot's head (skeleton or index), checksum checked, at most
        ``limit`` bytes (a larger one raises CheckpointCorruptError)."""
        self._check_bounds(slot, record)
        if record.skeleton_bytes > limit:
            raise CheckpointCorruptError(
                f"{self.path} slot {slot}: a head of {record.skeleton_bytes} bytes, "
                f"expected at most {limit}"
            )
        return self._skeleton(slot, record)

    def body(self, slot: int, record: rl.CommitRecord) -> memoryview:
        """A read-only view of a committed slot's data region (after the head); check it
        with :meth:`verify` first, and :meth:`record` after copying out of it."""
        self._check_bounds(slot, record)
        start = rl.data_offset(slot, self.slot_bytes) + record.tensor_offset
        return memoryview(self._map)[start : start + record.tensor_bytes].toreadonly()

    def verify(self, slot: int, record: rl.CommitRecord) -> None:
        """Check a committed slot's checksums; raises CheckpointCorruptError when torn.

        The tensor bytes are not hashed again when this mapping already hashed them for
        this very record: it committed the slot (an in-process restart reads back what
        its own process wrote), or verified it before (:meth:`start_checking`). That is
        as safe as hashing them again: the file is this user's alone (checked in
        :meth:`open`), and every writer (a worker's save, the launcher filling in a
        snapshot fetched from a peer) clears the slot's commit header before it touches
        the data and writes a new record, with a new sequence number and time, after
        it; an unchanged record therefore means unchanged bytes. Only a process of this
        user writing past that protocol could change them unseen, and such a process
        can write into this process's memory as well.
        """
        self._check_bounds(slot, record)
        self._skeleton(slot, record)
        if self._prechecking is not None:
            # Hashing it already, or another slot: either way over in a moment.
            self._prechecking.join()
        if self._checked.get(slot) == record and self.record(slot) == record:
            return
        if not self._hash_matches(slot, record, None):
            raise CheckpointCorruptError(f"{self.path} slot {slot}: tensor checksum differs")
        self._checked[slot] = record

    def _hash_matches(
        self, slot: int, record: rl.CommitRecord, stop: threading.Event | None
    ) -> bool | None:
        """Whether the slot's tensor bytes hash to the record's; None when stopped."""
        start = rl.data_offset(slot, self.slot_bytes) + record.tensor_offset
        end = start + record.tensor_bytes
        view = self._bytes
        assert view is not None
        hasher = xxhash.xxh3_64()
        with memoryview(self._map) as mv:
            for at in range(start, end, _HASH_CHUNK):
                if stop is not None and stop.is_set():
                    return None
                n = min(_HASH_CHUNK, end - at)
                try:
                    # Fill the page tables of the chunk in one call: faulting page by page
                    # while hashing measured several times slower. Pages already mapped
                    # (this mapping wrote them, or pre-faulted them) cost a page-table walk.
                    _advise(view.data_ptr() + at, n, _MADV_POPULATE_READ)
                except OSError as exc:
                    logger.debug("could not pre-fault the snapshot: %s", exc)
                hasher.update(mv[at : at + n])
        return hasher.intdigest() == record.tensor_hash

    def start_checking(self, rank: int, world_size: int | None, kind: str = rl.KIND_STATE) -> bool:
        """Verify ``rank``'s newest snapshot of ``kind`` here on a thread, once; whether
        one was started (``world_size`` None: saved by a world of any size).

        A restarted worker restores it soon, usually after setting up its process
        group, which mostly waits for its peers: hashing it meanwhile (it releases the
        GIL) takes it off the restore. A failure is left for the restore to find and
        report; :meth:`close` stops the thread between chunks.
        """
        if self._prechecking is not None:
            return False
        newest = next(
            (
                (slot, rec)
                for slot, rec in self.records()
                if rec.kind == kind
                and rec.rank == rank
                and (world_size is None or rec.world_size == world_size)
            ),
            None,
        )
        if newest is None:
            return False
        self._prechecking = threading.Thread(
            target=self._precheck, args=newest, name="stalwart-ram-verify", daemon=True
        )
        self._prechecking.start()
        return True

    def _precheck(self, slot: int, record: rl.CommitRecord) -> None:
        try:
            self._check_bounds(slot, record)
            self._skeleton(slot, record)
            if self._hash_matches(slot, record, self._closing):
                self._checked[slot] = record
        except (OSError, ValueError, CheckpointError) as exc:
            logger.debug("snapshot in slot %d does not verify: %s", slot, exc)

    def read(
        self,
        slot: int,
        record: rl.CommitRecord,
        *,
        weights_only: bool = True,
        threads: int = 1,
        into: Any = None,
        verified: bool = False,
    ) -> Any:
        """The state of a committed slot, verified and copied out; raises when torn.

        The checksums are checked before anything is copied (``verified``: the caller
        just did, with :meth:`verify`), so a torn slot never reaches the caller's
        tensors. ``into``: a state dict (nested dicts, lists, tuples) whose tensors
        receive the snapshot's at the same places, in place (see ``inplace.bind``);
        the result holds those very tensors there. Tensors without a counterpart are
        copied into fresh memory: a restored tensor never aliases the segment, which a
        later save overwrites.
        """
        self._check_bounds(slot, record)
        if not verified:
            self.verify(slot, record)
        skeleton = self._skeleton(slot, record)
        start = rl.data_offset(slot, self.slot_bytes) + record.tensor_offset
        wanted: list[tuple[torch.Tensor, TensorRef]] = []
        unpickler = SkeletonUnpickler(io.BytesIO(skeleton), wanted, weights_only)
        try:
            state = unpickler.load()
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{self.path} slot {slot}: {exc}") from exc
        for _, ref in wanted:
            if ref.offset + ref.nbytes > record.tensor_bytes:
                raise CheckpointCorruptError(f"{self.path} slot {slot}: tensor outside the slot")
        # Where each snapshot tensor goes: the caller's tensors at its places, and its
        # freshly allocated one unless every place it appears at was bound.
        targets: list[list[torch.Tensor]] = [[] for _ in wanted]
        bound = [0] * len(wanted)
        if into is not None:
            state, pairs = bind(state, into)
            for pair in pairs:
                i = unpickler.index_of[id(pair.loaded)]
                bound[i] += 1
                if not any(same_memory(pair.into, t) for t in targets[i]):
                    targets[i].append(pair.into)
        for i, (fresh, _) in enumerate(wanted):
            if bound[i] < unpickler.uses[i]:
                targets[i].append(fresh)
        with warnings.catch_warnings():
            # Only read from: torch warns about any buffer that is not writable.
            warnings.simplefilter("ignore", UserWarning)
            region = torch.frombuffer(
                self._map, dtype=torch.uint8, count=max(record.tensor_bytes, 1), offset=start
            )
        jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (_, ref), dsts in zip(wanted, targets, strict=True):
            if not ref.nbytes:
                continue
            src = ref_view(region, ref)
            for dst in dsts:
                if (
                    threads > 1
                    and ref.nbytes >= _SPLIT_BYTES
                    and dst.device.type == "cpu"
                    and dst.is_contiguous()
                ):
                    jobs.extend(
                        zip(dst.view(-1).chunk(threads), src.view(-1).chunk(threads), strict=True)
                    )
                else:
                    jobs.append((dst, src))
        _run_copies(jobs, threads)
        del region, jobs
        if self.record(slot) != record:
            # A writer clears the header before it touches the data and writes a new
            # one (a higher seq) after: an unchanged header means what was copied is
            # what was verified.
            raise CheckpointCorruptError(f"{self.path} slot {slot}: overwritten while read")
        return state

    def wait_populated(self) -> None:
        """Wait until the background pre-faulting of a writable mapping (if started) is done."""
        if self._populating is not None:
            self._populating.join()

    def close(self) -> None:
        # A page not faulted in yet costs nobody anything once we unmap: close in about
        # one chunk's time, not the whole segment's (seconds for a restored worker that
        # ends soon after its restore).
        self._closing.set()
        self.wait_populated()
        if self._prechecking is not None:
            self._prechecking.join()
        self._bytes = None
        try:
            self._map.close()
        except BufferError:
            logger.debug("snapshot segment still referenced; leaving it to the GC")
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class StagedSnapshot:
    """A snapshot copied into a slot and not yet committed."""

    slot: int
    step: int
    rank: int
    world_size: int
    seq: int
    skeleton_bytes: int
    tensor_offset: int
    tensor_bytes: int
    older: tuple[tuple[int, int], ...]  # (slot, step) of the other committed slots
    kind: str = rl.KIND_STATE


@dataclass(frozen=True)
class RamSnapshot:
    """A committed snapshot found in the launcher's memory (not yet verified)."""

    path: Path
    slot: int
    record: rl.CommitRecord

    @property
    def step(self) -> int:
        return self.record.step


def ram_folder() -> tuple[Path | None, str]:
    """The launcher's snapshot folder, or None with the reason there is none."""
    folder = os.environ.get(rl.RAM_DIR_ENV)
    if not folder:
        return None, f"{rl.RAM_DIR_ENV} is unset (not under `stalwart run --ckpt-ram`)"
    path = Path(folder)
    if not path.is_dir():
        return None, f"{rl.RAM_DIR_ENV}={folder} is not a folder (the launcher is gone?)"
    return path, ""


def open_local() -> tuple[RamSegment | None, str]:
    """This worker's segment (by ``LOCAL_RANK``), or None with the reason."""
    folder, why = ram_folder()
    if folder is None:
        return None, why
    local = os.environ.get(envvars.LOCAL_RANK, "0")
    try:
        return RamSegment.open(folder / rl.segment_name(int(local))), ""
    except (OSError, ValueError, CheckpointError) as exc:
        return None, f"cannot open the snapshot segment of local rank {local}: {exc}"


def find_snapshots(folder: Path, rank: int, world_size: int) -> list[RamSnapshot]:
    """Committed snapshots of ``rank`` in any segment of ``folder``, newest step first.

    Every segment is looked at: after a re-rendezvous a rank may run under another
    local rank than the one that wrote its snapshot.
    """
    found: list[RamSnapshot] = []
    try:
        names = sorted(p for p in folder.iterdir() if p.name.endswith(rl.SEGMENT_SUFFIX))
    except OSError:
        return found
    for path in names:
        try:
            seg = RamSegment.open(path, writable=False)
        except (OSError, ValueError, CheckpointError) as exc:
            # Treated like a corrupt checkpoint: this rank offers the steps it can
            # load, and the ranks agree on one of those (disk or an older snapshot).
            logger.warning("skipping snapshot segment %s: %s", path, exc)
            continue
        try:
            for slot, rec in seg.records():
                if rec.kind == rl.KIND_STATE and rec.rank == rank and rec.world_size == world_size:
                    found.append(RamSnapshot(path, slot, rec))
        finally:
            seg.close()
    return sorted(found, key=lambda s: (s.record.step, s.record.seq), reverse=True)


def load_snapshot(
    snap: RamSnapshot, *, weights_only: bool = True, threads: int = 1, into: Any = None
) -> Any:
    seg = RamSegment.open(snap.path, writable=False)
    try:
        return seg.read(
            snap.slot, snap.record, weights_only=weights_only, threads=threads, into=into
        )
    finally:
        seg.close()
