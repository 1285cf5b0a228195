"""Send this process's stdout or stderr to a file for the length of a ``with`` block.

The switch is made on the file descriptor, so what C code, ``os.system`` and child
processes write lands in the file as well as Python's ``print``.  When ``sys.stdout``
is not backed by fd 1 (pytest's capture, for one, gives it a file of its own), that
descriptor is switched too, so Python's output is not left behind.

The destination is opened without following a link and without waiting for a reader:
a FIFO, device or link planted at the path is refused with a ``ValueError`` before
anything is switched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import sys
from collections.abc import Iterator
from functools import partial
from typing import TextIO

_STREAMS = ("stdout", "stderr")
_FDS = {"stdout": 1, "stderr": 2}

# Truncates, as torch's redirect does: the block's output replaces the file's content.
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)


def _flush(stream: TextIO) -> None:
    # C stdio buffers are flushed too (fflush(NULL) flushes every output stream), so a
    # printf made before the switch is not written after it, into the wrong file.
    with contextlib.suppress(OSError, ValueError):
        stream.flush()
    _libc.fflush(None)


def open_regular(path: str | os.PathLike[str], flags: int, what: str) -> int:
    """A blocking fd for writing to `path`, opened with `flags` (which must carry
    ``O_NOFOLLOW | O_NONBLOCK``, so a planted link is refused and a planted FIFO never
    blocks the open); anything but a regular file is a one-line `ValueError`."""
    name = os.fspath(path)
    try:
        fd = os.open(name, flags, 0o644)
    except OSError as e:
        raise ValueError(
            f"{what} {name!r}: cannot open it for writing "
            f"({e.strerror or e}); expected a regular file or a new path, not a link"
        ) from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{what} {name!r} is {stat.filemode(mode)!r}: expected a regular file")
    # The flag was only for the open; children that inherit the fd must not see it.
    os.set_blocking(fd, True)
    return fd


def _open_destination(to_file: str | os.PathLike[str]) -> int:
    return open_regular(to_file, _OPEN_FLAGS, "redirect destination")


def _targets(std: str) -> list[int]:
    fds = [_FDS[std]]
    stream: TextIO = getattr(sys, std)
    try:
        own = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return fds  # an in-memory stream: only the descriptor can be switched
    if own not in fds and own >= 0:
        fds.append(own)
    return fds


@contextlib.contextmanager
def redirect(std: str, to_file: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, *std* (``"stdout"`` or ``"stderr"``) writes to *to_file*, which
    is created or truncated; the stream is restored when the block ends, also on error."""
    if std not in _STREAMS:
        raise ValueError(f"redirect: unknown stream {std!r}: expected 'stdout' or 'stderr'")
    stream: TextIO = getattr(sys, std)
    dst = _open_destination(to_file)
    saved: list[tuple[int, int]] = []
    try:
        _flush(stream)
        for fd in _targets(std):
            saved.append((fd, os.dup(fd)))
            os.dup2(dst, fd, inheritable=fd in (1, 2))
        yield
    finally:
        _flush(stream)
        for fd, copy in reversed(saved):
            os.dup2(copy, fd, inheritable=fd in (1, 2))
            os.close(copy)
        os.close(dst)


redirect_stdout = partial(redirect, "stdout")
redirect_stderr = partial(redirect, "stderr")

__all__ = ["redirect", "redirect_stderr", "redirect_stdout"]
