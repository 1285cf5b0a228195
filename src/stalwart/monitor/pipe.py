"""Worker side of the node's named pipe: one persistent descriptor, atomic paced writes.

torch's client writes non-blocking and lets BlockingIOError reach the caller once the
pipe is full. Here a full pipe means "wait until the server drains it" (bounded by a
deadline), so bursts of requests are paced instead of failing.
"""

from __future__ import annotations

import errno
import os
import select
import threading


class PipeError(RuntimeError):
    """The monitor's pipe cannot be written (no server, or it stopped reading)."""


class PipeWriter:
    """Writes whole lines (each <= PIPE_BUF) to a FIFO; reopens after fork."""

    def __init__(self, path: str, full_pipe_wait: float = 10.0, keep_open: bool = True) -> None:
        self.path = path
        self.full_pipe_wait = full_pipe_wait
        # torch's FileTimerServer blocks in readline() while any writer holds the pipe
        # open, so its expiry checks starve; against it, open-write-close each message.
        self.keep_open = keep_open
        self._fd = -1
        self._pid = -1
        self._lock = threading.Lock()

    def _open(self) -> int:
        pid = os.getpid()
        if self._fd >= 0 and self._pid == pid:
            return self._fd
        try:
            # Non-blocking open fails at once (ENXIO) when no server holds the pipe open,
            # instead of blocking this rank forever.
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise PipeError(f"no monitor is reading {self.path}") from None
            raise PipeError(f"cannot open monitor pipe {self.path}: {exc.strerror}") from None
        self._fd, self._pid = fd, pid
        return fd

    def write(self, line: bytes) -> None:
        with self._lock:
            fd = self._open()
            poller: select.poll | None = None
            while True:
                try:
                    written = os.write(fd, line)
                except BlockingIOError:
                    # A write of <= PIPE_BUF bytes either goes in whole or not at all.
                    if poller is None:
                        poller = select.poll()
                        poller.register(fd, select.POLLOUT)
                    if not poller.poll(self.full_pipe_wait * 1000):
                        raise PipeError(
                            f"monitor pipe {self.path} stayed full for {self.full_pipe_wait} s"
                        ) from None
                    continue
                except BrokenPipeError:
                    self.close()
                    raise PipeError(f"monitor stopped reading {self.path}") from None
                if written != len(line):
                    raise PipeError(f"short write to {self.path} ({written} of {len(line)} bytes)")
                if not self.keep_open:
                    self.close()
                return

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = -1
