"""Linux process-control primitives the launcher relies on (prctl through libc)."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time
from typing import Protocol

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send *sig* to this process when its parent thread dies."""
    if _libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_child_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init, so the
    launcher can still see (and kill) a worker's children after the worker died."""
    return bool(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def pdeathsig_then_check(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Set the parent-death signal and close the race where the parent already died."""
    set_parent_death_signal(sig)
    if os.getppid() != expected_parent:
        os._exit(128 + int(sig))


def killpg_quiet(pgid: int, sig: int) -> bool:
    """Signals a process group; False if it no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def reap_orphans(keep: set[int]) -> list[int]:
    """Reaps exited children that are not in *keep*: as a subreaper the launcher inherits
    its workers' orphaned descendants, and must collect them or they stay zombies.
    Children in *keep* have owners (``Popen``, the worker handles) that wait for them."""
    import psutil

    reaped: list[int] = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return reaped
    for child in children:
        if child.pid in keep:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                continue
            pid, _ = os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue
        if pid:
            reaped.append(pid)
    return reaped


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
            for fd, _ev in self._poller.poll():
                if fd == self._r:
                    return
                w = self._fds.pop(fd)
                self._poller.unregister(fd)
                os.close(fd)
                w.exited_at = time.time()
                self.changed.set()

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
