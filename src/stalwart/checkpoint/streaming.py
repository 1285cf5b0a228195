"""Checksumming a file and pushing it to disk *while* it is being written.

``torch.save`` streams into :class:`ProgressSink`, which only counts bytes. A
:class:`ChecksumFollower` thread trails behind it: it reads back each newly
written range from the page cache, feeds it to the hasher, and asks the kernel
to start writing that range to disk. Hashing and disk I/O thus overlap the
serialisation instead of following it, and the checksum is of the bytes the
file really holds, not of a buffer we hope matches it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import threading
from typing import Any

from .manifest import Hasher

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2


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
