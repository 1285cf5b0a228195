"""Streaming ``torch.save`` output to disk while checksumming it.

Two ways, chosen per file:

* :class:`DirectStream` (the default where the file system allows ``O_DIRECT``):
  ``torch.save``'s output is copied into a few page-aligned buffers that the
  writer process allocates once and reuses, and a thread hashes each full
  buffer and writes it with ``O_DIRECT``. No page-cache pages are allocated.
  That matters more than it sounds: on a VM whose free memory is handed back
  to the host (free page reporting, ballooning) every freshly allocated page
  costs a host fault, measured at 1-3 s per GiB here against 0.15 s for the
  copy itself, and a buffered write of a 1 GiB file allocates 1 GiB of fresh
  page cache every time.
* :class:`BufferedStream` (fallback): ``torch.save`` writes through the page
  cache and a :class:`ChecksumFollower` thread trails behind it, reading each
  newly written range back, hashing it and starting its writeback, so hashing
  and disk I/O overlap the serialisation instead of following it.

Either way the checksum is of exactly the bytes handed to the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import queue
import threading
import warnings
from typing import Any, Protocol

import torch

from .manifest import Hasher

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2
# O_DIRECT needs file offsets, lengths and memory addresses aligned to the
# device's logical block; 4 KiB covers every common disk and file system.
DIRECT_ALIGN = 4096
DIRECT_CHUNK = 8 << 20
DIRECT_CHUNKS = 4
# Writes at least this large are written from the caller's memory when aligned.
ZERO_COPY_MIN = 64 << 10


def _load_sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to begin writing a range (non-blocking); a no-op where unsupported."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class ChecksumFollower(threading.Thread):
    """Hashes ``fd`` from offset 0 up to whatever the writer has reported so far."""

    def __init__(self, fd: int, hasher: Hasher) -> None:
        super().__init__(name="stalwart-ckpt-hash", daemon=True)
        self._fd = fd
        self._hasher = hasher
        self._cond = threading.Condition()
        self._written = 0
        self._finished = False
        self._hashed = 0
        self.error: BaseException | None = None

    def advance(self, written: int) -> None:
        with self._cond:
            self._written = written
            self._cond.notify()

    def finish(self, written: int) -> int:
        """Tell the follower the file is complete; wait and return bytes hashed."""
        with self._cond:
            self._written = written
            self._finished = True
            self._cond.notify()
        self.join()
        if self.error is not None:
            raise self.error
        return self._hashed

    def run(self) -> None:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            while True:
                with self._cond:
                    while self._hashed >= self._written and not self._finished:
                        self._cond.wait()
                    target, finished = self._written, self._finished
                while self._hashed < target:
                    want = min(_CHUNK, target - self._hashed)
                    n = os.preadv(self._fd, [view[:want]], self._hashed)
                    if n <= 0:
                        raise OSError(errno.EIO, "file shorter than the bytes written to it")
                    self._hasher.update(view[:n])
                    start_writeback(self._fd, self._hashed, n)
                    self._hashed += n
                if finished and self._hashed >= target:
                    return
        except BaseException as exc:
            self.error = exc


class ProgressSink:
    """File-like object for ``torch.save``: writes through and reports progress."""

    def __init__(self, raw: Any, follower: ChecksumFollower) -> None:
        self._raw = raw
        self._follower = follower
        self.size = 0
        self._reported = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        done = 0
        while done < total:
            n = self._raw.write(view[done:])
            if n is None or n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n
        self.size += total
        # Waking the follower for every tiny header record costs more than it saves.
        if self.size - self._reported >= _CHUNK:
            self._reported = self.size
            self._follower.advance(self.size)
        return total

    def flush(self) -> None:
        self._raw.flush()


class OutputStream(Protocol):
    """What :func:`open_output` returns: a file-like sink for ``torch.save``."""

    direct: bool

    @property
    def size(self) -> int: ...
    def write(self, data: Any) -> int: ...
    def flush(self) -> None: ...
    def finish(self) -> int: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


class BufferedStream:
    """Page-cache write with a :class:`ChecksumFollower` hashing behind it."""

    direct = False

    def __init__(self, path: str, hasher: Hasher) -> None:
        # Read access too: the follower reads the file back to hash it.
        self._raw = open(path, "x+b", buffering=0)  # noqa: SIM115 - closed in close()
        self._follower = ChecksumFollower(self._raw.fileno(), hasher)
        self._follower.start()
        self._sink = ProgressSink(self._raw, self._follower)
        self._finished = False

    @property
    def size(self) -> int:
        return self._sink.size

    def write(self, data: Any) -> int:
        return self._sink.write(data)

    def flush(self) -> None:
        self._sink.flush()

    def finish(self) -> int:
        self._finished = True
        return self._follower.finish(self._sink.size)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self._finished:
            # Stop the follower even when torch.save failed half way.
            with contextlib.suppress(BaseException):
                self.finish()
        self._raw.close()


class ChunkPool:
    """Page-aligned buffers for ``O_DIRECT`` writes, faulted in once, reused by every save.

    Reusing them is the point: their pages are already backed, whereas fresh
    memory (or fresh page cache) can cost a host fault per page on a VM.
    """

    def __init__(self, chunk_bytes: int = DIRECT_CHUNK, count: int = DIRECT_CHUNKS) -> None:
        if chunk_bytes % DIRECT_ALIGN or count < 2:
            raise ValueError("chunks must be a multiple of the alignment, at least two")
        self.chunk_bytes = chunk_bytes
        self._maps = [mmap.mmap(-1, chunk_bytes) for _ in range(count)]
        zeros = bytes(chunk_bytes)
        for m in self._maps:
            m.write(zeros)  # fault the pages in now, during the writer's start-up
        self.views = [memoryview(m) for m in self._maps]

    def close(self) -> None:
        for v in self.views:
            v.release()
        for m in self._maps:
            m.close()


class DirectStream:
    """``O_DIRECT`` writer: a second thread writes while ``torch.save`` goes on.

    Large writes whose memory address and file offset are both block-aligned
    (the staging buffer and the file's storage records are laid out for that,
    see ``storage_alignment``) are written straight from the caller's memory,
    no copy; everything else is copied into pool chunks. Either way the bytes
    are hashed here, in stream order, and handed to the I/O thread. The source
    memory of a zero-copy write is read until :meth:`finish` returns.

    The tail of the file that does not fill a whole block is written through
    the page cache (``O_DIRECT`` cleared on the descriptor), so the file has
    its exact size without padding or truncation.
    """

    direct = True

    def __init__(self, fd: int, pool: ChunkPool, hasher: Hasher) -> None:
        self._fd = fd
        self._pool = pool
        self._hasher = hasher
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(pool.views)):
            self._free.put(i)
        # (bytes to write, file offset, pool chunk to hand back or -1)
        self._todo: queue.SimpleQueue[tuple[memoryview, int, int] | None] = queue.SimpleQueue()
        self._cur = self._free.get()
        self._fill = 0
        self._offset = 0  # file offset of the current chunk; + _fill == size
        self.size = 0
        self.zero_copy_bytes = 0
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stalwart-ckpt-direct", daemon=True)
        self._thread.start()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        if self.error is not None:
            raise self.error
        done = 0
        if total >= ZERO_COPY_MIN and self.size % DIRECT_ALIGN == 0:
            aligned = total - total % DIRECT_ALIGN
            if _address(view) % DIRECT_ALIGN == 0:
                if self._fill:
                    self._submit()  # ends on a block boundary, since size does
                self._hasher.update(view[:aligned])
                self._todo.put((view[:aligned], self.size, -1))
                self._offset = self.size + aligned
                self.zero_copy_bytes += aligned
                done = aligned
        self._copy(view, done)
        self.size += total
        return total

    def _copy(self, view: memoryview, done: int) -> None:
        chunk = self._pool.chunk_bytes
        total = len(view)
        while done < total:
            if self.error is not None:
                raise self.error
            n = min(chunk - self._fill, total - done)
            self._pool.views[self._cur][self._fill : self._fill + n] = view[done : done + n]
            self._fill += n
            done += n
            if self._fill == chunk:
                self._submit()

    def flush(self) -> None:
        pass

    def _submit(self) -> None:
        # Hashed here, in stream order, while the chunk is still in the CPU cache;
        # the I/O thread only writes.
        filled = self._pool.views[self._cur][: self._fill]
        self._hasher.update(filled)
        self._todo.put((filled, self._offset, self._cur))
        self._offset += self._fill
        self._fill = 0
        self._cur = self._free.get()

    def finish(self) -> int:
        """Write what is left, wait for every write; return the bytes written."""
        if self._fill and self.error is None:
            self._submit()
        self._stop()
        if self.error is not None:
            raise self.error
        return self.size

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        self._stop()
        os.close(self._fd)

    def _stop(self) -> None:
        if not self._closed:
            self._closed = True
            self._todo.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            view, offset, idx = item
            try:
                if self.error is None:
                    self._write_chunk(view, offset)
            except BaseException as exc:
                self.error = exc
            finally:
                view.release()
                if idx >= 0:
                    # Even after an error: the producer may be waiting for a free chunk.
                    self._free.put(idx)

    def _write_chunk(self, view: memoryview, offset: int) -> None:
        aligned = len(view) - len(view) % DIRECT_ALIGN
        done = 0
        while done < aligned:
            try:
                n = os.pwrite(self._fd, view[done:aligned], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not _direct_enabled(self._fd):
                    raise
                # The file system took O_DIRECT at open but refuses this
                # alignment: carry on through the page cache.
                logger.debug("O_DIRECT write refused (%s); writing buffered", exc)
                _set_direct(self._fd, False)
                continue
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n
        if aligned < len(view):
            _set_direct(self._fd, False)
            _pwrite_all(self._fd, view[aligned:], offset + aligned)


def _address(view: memoryview) -> int:
    # torch hands storages over as read-only memoryviews, which ctypes cannot
    # wrap; torch.frombuffer can (and warns that it is read-only: we only read).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return int(torch.frombuffer(view, dtype=torch.uint8).data_ptr())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def _direct_enabled(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


def _set_direct(fd: int, on: bool) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    o_direct = getattr(os, "O_DIRECT", 0)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | o_direct) if on else (flags & ~o_direct))


def open_output(path: str, hasher: Hasher, pool: ChunkPool | None) -> OutputStream:
    """A new file at ``path`` (which must not exist): direct I/O if ``pool`` is given
    and the file system accepts ``O_DIRECT``, else buffered."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if pool is not None and o_direct:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | o_direct
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            logger.debug("%s refuses O_DIRECT; writing through the page cache", path)
        else:
            return DirectStream(fd, pool, hasher)
    return BufferedStream(path, hasher)
