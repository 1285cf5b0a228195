"""The shared staging buffer and the snapshot of a state dict into it.

A snapshot has two parts. The *skeleton* is the state dict pickled with every
tensor replaced by a :class:`TensorRef` (offset, dtype, shape); it is small and
captures all Python objects at the time of the call. The tensor *bytes* are
copied into one shared-memory region that the writer child maps too, so tensor
data is never pickled or sent through a pipe.

The region is an anonymous memory file (``memfd``), handed to the child as an
inherited file descriptor, so nothing is left behind in ``/dev/shm`` if either
process is killed. It is allocated and pre-faulted once and grows only when a
state dict no longer fits: faulting fresh pages costs several times the copy
itself on this kind of machine.
"""

from __future__ import annotations

import errno
import io
import logging
import mmap
import os
import pickle
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import StagingConflictError
from .messages import StagedState

logger = logging.getLogger(__name__)

# Staged tensors start at multiples of this many bytes in the buffer.
TENSOR_ALIGN = 64
# ... and large ones at page boundaries, so that the writer, whose file puts
# each tensor at a block boundary too, can write them with O_DIRECT straight
# from the shared buffer (see streaming.DirectStream).
PAGE_ALIGN = 4096
PAGE_ALIGN_FROM = 64 << 10
_GROW_GRANULE = 2 << 20
# Linux >= 5.14: fault pages in writable without writing them ourselves.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_GROW_FACTOR = 1.25
# Copies larger than this are split across the copy threads.
_SPLIT_BYTES = 32 << 20


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives in the staging buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    parameter: bool = False
    requires_grad: bool = False


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _stageable(t: torch.Tensor) -> bool:
    # Sparse, quantized, nested and meta tensors, and tensor subclasses, fall back
    # to ordinary pickling inside the skeleton: correct, just not zero-copy.
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and t.device.type != "meta"
    )


def _version_of(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference-mode tensors carry no version counter
        return -1


@dataclass
class StagingPlan:
    """Tensors found while pickling the skeleton and where each one goes."""

    skeleton: bytes = b""
    used_bytes: int = 0
    copies: list[tuple[torch.Tensor, TensorRef, int]] = field(default_factory=list)
    # The lent head of the buffer (see SharedBuffer.lend): tensors that already live
    # there are referenced where they are, not copied.
    in_place: torch.Tensor | None = None
    in_place_bytes: int = 0
    _by_id: dict[int, TensorRef] = field(default_factory=dict)

    def add(self, t: torch.Tensor) -> TensorRef:
        known = self._by_id.get(id(t))
        if known is not None:
            return known
        nbytes = t.numel() * t.element_size()
        offset = self._offset_in_place(t, nbytes)
        if offset is not None:
            ref = _ref(t, offset, nbytes)
            self._by_id[id(t)] = ref
            self.in_place_bytes += nbytes
            return ref
        if nbytes >= PAGE_ALIGN_FROM:
            self.used_bytes = _round_up(self.used_bytes, PAGE_ALIGN)
        ref = _ref(t, self.used_bytes, nbytes)
        self.used_bytes = _round_up(self.used_bytes + nbytes, TENSOR_ALIGN)
        self._by_id[id(t)] = ref
        self.copies.append((t, ref, _version_of(t)))
        return ref

    def _offset_in_place(self, t: torch.Tensor, nbytes: int) -> int | None:
        region = self.in_place
        if region is None or nbytes == 0 or t.device.type != "cpu" or not t.is_contiguous():
            return None
        start = t.data_ptr() - region.data_ptr()
        if start >= 0 and start + nbytes <= region.numel():
            return start
        return None


def _ref(t: torch.Tensor, offset: int, nbytes: int) -> TensorRef:
    return TensorRef(
        offset=offset,
        nbytes=nbytes,
        dtype=t.dtype,
        shape=tuple(t.shape),
        parameter=isinstance(t, torch.nn.Parameter),
        requires_grad=t.requires_grad,
    )


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, plan: StagingPlan) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._plan = plan

    def persistent_id(self, obj: Any) -> TensorRef | None:
        if isinstance(obj, torch.Tensor) and _stageable(obj):
            return self._plan.add(obj)
        return None


def plan(state: Any, in_place: torch.Tensor | None = None) -> StagingPlan:
    """Pickle the skeleton now; tensors are only referenced, not yet copied.

    ``in_place``: the buffer's lent head (:meth:`SharedBuffer.lend`); tensors inside
    it are written from where they are, the others are copied after it.
    """
    result = StagingPlan(in_place=in_place)
    if in_place is not None:
        result.used_bytes = _round_up(in_place.numel(), PAGE_ALIGN)
    buf = io.BytesIO()
    _SkeletonPickler(buf, result).dump(state)
    result.skeleton = buf.getvalue()
    # Drop the identity map: ids may be reused once the caller frees tensors.
    result._by_id.clear()
    result.in_place = None
    return result


def _create_memory_file() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("stalwart-ckpt-staging", os.MFD_CLOEXEC)
    # Portable fallback: an already-unlinked temporary file, RAM-backed if possible.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryFile(dir=shm) as f:
        return os.dup(f.fileno())


def _map(fd: int, size: int, *, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED
    if populate and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    return mmap.mmap(fd, size, flags=flags)


def _unmap(m: mmap.mmap | None) -> None:
    if m is None:
        return
    try:
        m.close()
    except BufferError:
        # A tensor (perhaps held by a traceback) still views it; the garbage
        # collector unmaps it once that reference is gone.
        logger.debug("staging map still referenced; leaving it to the GC")


class SharedBuffer:
    """Parent side: owns the memory file and copies tensors into it."""

    def __init__(self, copy_threads: int = 1) -> None:
        self.fd = _create_memory_file()
        self.capacity = 0
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._copy_threads = max(1, copy_threads)
        self._lock = threading.Lock()
        # Set by a provisional (estimated) reservation: the next snapshot, which
        # knows the real size, gives back what it does not need.
        self._trim_on_next_use = False
        # The head of the buffer a stager fills in place (see lend); None until then.
        self._lent: torch.Tensor | None = None

    @property
    def lent(self) -> torch.Tensor | None:
        """The region last handed out by :meth:`lend` (uint8), or None."""
        return self._lent

    def lend(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer as a uint8 tensor to stage into directly.

        Whatever the caller places there is written from where it is (see
        :func:`plan`); other tensors of a snapshot are copied after it. The region's
        memory stays mapped as long as a view of it lives, also after the buffer grew
        or closed, so a stale view never points at unmapped memory. The caller must
        not fill it while the writer reads it (``CheckpointProcess.lend`` waits).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: expected >= 0")
        if self.fd < 0:
            raise RuntimeError("the staging buffer is closed")
        self.ensure(max(nbytes, 1))
        with self._lock:
            assert self._bytes is not None
            self._lent = self._bytes[:nbytes]
            return self._lent

    def ensure(self, nbytes: int, *, provisional: bool = False, prefault: bool = False) -> None:
        """Grow so that ``nbytes`` fit (never shrink here).

        ``prefault``: also touch every new page now. A reservation must: shmem
        ``fallocate`` only books the pages, and the first write to each one
        still pays the zeroing and, on a VM that returns free memory to its
        host, a host fault (1-3 s per GiB here), i.e. the very cost a
        reservation is meant to take off the first save.
        """
        with self._lock:
            if provisional:
                self._trim_on_next_use = True
            if nbytes <= self.capacity:
                return
            new_cap = _round_up(max(nbytes, int(self.capacity * _GROW_FACTOR)), _GROW_GRANULE)
            logger.info("staging buffer: %d -> %d MiB", self.capacity >> 20, new_cap >> 20)
            self._resize(new_cap)
            try:
                # Allocate the pages now: out of memory is then an error here,
                # not a SIGBUS in the middle of a copy.
                os.posix_fallocate(self.fd, 0, new_cap)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            if prefault:
                # From 0: pages the earlier capacity left untouched (headroom)
                # are cold too; populated ones cost only a page-table walk.
                self._prefault(0, new_cap)

    def _prefault(self, start: int, end: int) -> None:
        assert self._map is not None and self._bytes is not None
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, start, end - start)
        except (OSError, ValueError):
            # Kernels before 5.14: write to every page instead.
            self._bytes[start:end].zero_()

    def _trim_to(self, nbytes: int) -> None:
        with self._lock:
            if not self._trim_on_next_use:
                return
            self._trim_on_next_use = False
            target = _round_up(max(int(nbytes * _GROW_FACTOR), 1), _GROW_GRANULE)
            if self._lent is not None:
                # Past the file's end a live view of the lent region would fault.
                target = max(target, _round_up(self._lent.numel(), _GROW_GRANULE))
            if target < self.capacity:
                logger.info("staging buffer: %d -> %d MiB", self.capacity >> 20, target >> 20)
                self._resize(target)

    def _resize(self, new_cap: int) -> None:
        # Growing keeps the pages already faulted in; shrinking frees the rest.
        # The child re-maps when a snapshot names a new capacity.
        self._drop_map()
        os.ftruncate(self.fd, new_cap)
        # Not MAP_POPULATE: the copy threads fault the pages in, in parallel,
        # which measured a little faster than one populating mmap call.
        self._map = _map(self.fd, new_cap, populate=False)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.capacity = new_cap

    def copy_in(
        self, staging: StagingPlan, *, check_versions: bool = False, threads: int | None = None
    ) -> StagedState:
        """Copy the planned tensors into the buffer (growing it first if needed).

        ``threads`` defaults to the buffer's ``copy_threads``.
        """
        threads = self._copy_threads if threads is None else max(1, threads)
        self._trim_to(staging.used_bytes)
        self.ensure(max(staging.used_bytes, 1))
        assert self._bytes is not None
        copy_planned(self._bytes, staging, threads)
        if check_versions:
            check_unchanged(staging)
        return StagedState(
            skeleton=staging.skeleton, used_bytes=staging.used_bytes, capacity=self.capacity
        )

    def _drop_map(self) -> None:
        old, self._map, self._bytes = self._map, None, None
        if self._lent is None:
            _unmap(old)
        # else: views of the lent region (a stager's buffers) hold the old map; it is
        # unmapped when the last of them goes, never under them.

    def close(self) -> None:
        with self._lock:
            self._drop_map()
            self._lent = None
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


def check_unchanged(staging: StagingPlan) -> None:
    """Raise if a planned tensor was modified in place (autograd version) since ``plan``."""
    for src, _, version in staging.copies:
        if version >= 0 and _version_of(src) != version:
            raise StagingConflictError(
                "a tensor in the state dict was modified in place while the "
                "background snapshot was copying it; wait for staging "
                "(AsyncCheckpointer.wait_staged) before mutating the model"
            )


def ref_view(base: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """The tensor ``ref`` describes, viewed in the bytes ``base`` (uint8, offset 0)."""
    return base[ref.offset : ref.offset + ref.nbytes].view(ref.dtype).view(ref.shape)


def copy_planned(base: torch.Tensor, staging: StagingPlan, threads: int) -> None:
    """Copy the planned tensors to their places in ``base`` (uint8 bytes) with ``threads``."""
    jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for src, ref, _ in staging.copies:
        if ref.nbytes == 0:
            continue
        dst = ref_view(base, ref)
        s = src.detach()
        if threads > 1 and ref.nbytes >= _SPLIT_BYTES and s.is_contiguous():
            # Split big tensors so every copy thread gets a share.
            for d_part, s_part in zip(
                dst.view(-1).chunk(threads),
                s.view(-1).chunk(threads),
                strict=True,
            ):
                jobs.append((d_part, s_part))
        else:
            jobs.append((dst, s))
    _run_copies(jobs, threads)


class _CopyPool:
    """Helper threads for copies, started once per process and reused by every save.

    A save at every step would otherwise start and join threads each time. Forked
    children (warm workers) do not inherit threads, so a pool from another pid is
    replaced rather than submitted to.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._size = 0

    def get(self, helpers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid() or self._size < helpers:
                old = self._pool if self._pid == os.getpid() else None
                self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="stalwart-copy")
                self._pid, self._size = os.getpid(), helpers
                if old is not None:
                    old.shutdown(wait=False)
            return self._pool


_copy_pool = _CopyPool()


def _copy_bucket(bucket: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in bucket:
            dst.copy_(src)


def _run_copies(jobs: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> None:
    if threads <= 1 or len(jobs) <= 1:
        _copy_bucket(jobs)
        return
    # Round-robin by size keeps the threads balanced; copy_ drops the GIL.
    order = sorted(jobs, key=lambda j: j[0].numel() * j[0].element_size(), reverse=True)
    buckets: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for job in order:
        i = loads.index(min(loads))
        buckets[i].append(job)
        loads[i] += job[0].numel() * job[0].element_size()
    pool = _copy_pool.get(threads - 1)
    helpers = [pool.submit(_copy_bucket, b) for b in buckets[1:] if b]
    first: BaseException | None = None
    try:
        _copy_bucket(buckets[0])
    except BaseException as exc:
        first = exc
    for h in helpers:
        # Every helper is waited for, also after a failure: none may still be
        # writing once this returns.
        failed = h.exception()
        if failed is not None and first is None:
            first = failed
    if first is not None:
        raise first


class BufferView:
    """Child side: maps the inherited memory file and rebuilds tensors from it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._map: mmap.mmap | None = None
        self._size = 0

    def _attach(self, capacity: int) -> mmap.mmap:
        if self._map is None or self._size != capacity:
            _unmap(self._map)
            self._map = _map(self._fd, capacity, populate=False)
            self._size = capacity
        return self._map

    def unstage(self, staged: StagedState) -> Any:
        m = self._attach(staged.capacity)
        return _SkeletonUnpickler(io.BytesIO(staged.skeleton), m).load()


def _tensor_from_map(m: mmap.mmap, ref: TensorRef) -> torch.Tensor:
    if ref.nbytes == 0:
        t = torch.empty(ref.shape, dtype=ref.dtype)
    else:
        count = ref.nbytes // torch.empty((), dtype=ref.dtype).element_size()
        # frombuffer gives each tensor its own storage of exactly its bytes, so
        # torch.save writes one record per tensor straight from shared memory.
        t = torch.frombuffer(m, dtype=ref.dtype, count=count, offset=ref.offset).view(ref.shape)
    if ref.parameter:
        return torch.nn.Parameter(t, requires_grad=ref.requires_grad)
    return t


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, m: mmap.mmap) -> None:
        super().__init__(file)
        self._m = m
        # One tensor per ref, so an object saved twice stays one object.
        self._seen: dict[TensorRef, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, TensorRef):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        # By the whole ref: tensors staged in place may start at the same offset
        # (a tensor and a narrower view of it) and still differ.
        t = self._seen.get(pid) if pid.nbytes else None
        if t is None:
            t = _tensor_from_map(self._m, pid)
            if pid.nbytes:
                self._seen[pid] = t
        return t
