"""Watching the launcher's workers exit through pidfds (the process primitives it
stands on are in ``stalwart.base.procs``)."""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Protocol


class Watched(Protocol):
    """What ``ExitWatcher`` needs of a process handle."""

    pid: int
    exited_at: float | None


class ExitWatcher:
    """Waits on pidfds in a thread: records each worker's exit time and wakes waiters."""

    def __init__(self) -> None:
        self.changed = threading.Event()
        self._poller = select.poll()
        self._fds: dict[int, Watched] = {}
        self._r, self._w = os.pipe()  # wakes the thread when closing
        self._poller.register(self._r, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name="stalwart-exits", daemon=True)
        self._closed = False

    def watch(self, w: Watched) -> None:
        try:
            fd = os.pidfd_open(w.pid)
        except OSError:  # already gone or no pidfd support: poll() still sees it
            w.exited_at = time.time()
            self.changed.set()
            return
        self._fds[fd] = w
        self._poller.register(fd, select.POLLIN)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while self._fds:
            ready = [fd for fd, _ev in self._poller.poll()]
            # Exits that came with the wake-up are recorded first: a worker that died
            # during the teardown still has its exit time.
            for fd in ready:
                if fd == self._r:
                    continue
                w = self._fds.pop(fd)
                self._poller.unregister(fd)
                os.close(fd)
                w.exited_at = time.time()
                self.changed.set()
            if self._r in ready:
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._w, b"x")
        if self._thread.is_alive():
            self._thread.join()
        for fd in list(self._fds):
            os.close(fd)
        self._fds.clear()
        os.close(self._r)
        os.close(self._w)
