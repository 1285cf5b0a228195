"""Progress timestamps shared with the monitor process, and the periodic threads.

The clock is a 32-byte file mapped into memory (in /dev/shm when it exists) so
the monitor process can read it even while this interpreter is stuck with the
GIL held.  Layout (little-endian doubles): automatic tick, last ``ping()``,
manual mode armed (1.0/0.0), closed flag.  All times are ``time.monotonic()``,
which is system-wide on Linux.

Two ``Periodic`` threads refresh the automatic tick and this rank's store
heartbeat every ``interval``. While the wrapped function runs, the automatic tick
is taken *on the main thread*: the tick thread only asks the interpreter to run a
pending call there (``Py_AddPendingCall``), which happens at the main thread's
next bytecode. So a main thread blocked in C with the GIL released (a collective
that never completes, a stuck read) stops the tick as surely as one holding the
GIL for good, and the soft and hard timeouts see it, as NVIDIA's progress
watchdog does. Outside the function (the wrapper's own barriers and hooks) the
tick is taken on the tick thread itself: waiting for peers is not a hang.

The pending call is libc's ``sem_post`` on a private semaphore, not Python: a
Python callback run there would be where an asynchronous restart exception
(raised into the main thread by the monitor thread, typically just as a blocked
call returns) lands, and ctypes would swallow it as unraisable. The tick thread
takes the semaphore back with ``sem_trywait``; success means the main thread ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

LAYOUT = struct.Struct("<dddd")
AUTO, MANUAL, ARMED, CLOSED = range(4)

# int (*)(void *): the signature CPython expects of a pending call, and of sem_post.
_PENDING_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_add_pending_call = ctypes.pythonapi.Py_AddPendingCall
_add_pending_call.restype = ctypes.c_int
_add_pending_call.argtypes = [_PENDING_CALL, ctypes.c_void_p]
# sizeof(sem_t) is 32 on x86_64/aarch64 glibc and musl; room to spare for others.
_SEM_BYTES = 64


class MainThreadProbe:
    """Tells from another thread whether the main thread has run bytecode since the
    last look, without running any Python on the main thread (see the module text).

    One per process, never freed: a request still queued in the interpreter when a
    clock closes must find its semaphore alive."""

    _instance: MainThreadProbe | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._sem = ctypes.create_string_buffer(_SEM_BYTES)
        if libc.sem_init(self._sem, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._trywait = libc.sem_trywait
        self._trywait.argtypes = [ctypes.c_void_p]
        self._trywait.restype = ctypes.c_int
        address = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
        if address is None:
            raise OSError("sem_post not found")
        self._post = _PENDING_CALL(address)
        self._address = ctypes.addressof(self._sem)
        self._queued = False
        self._asking = threading.Lock()

    @classmethod
    def get(cls) -> MainThreadProbe | None:
        """The process's probe, or None where libc has no POSIX semaphores."""
        with cls._lock:
            if cls._instance is None:
                try:
                    cls._instance = cls()
                except (OSError, AttributeError) as exc:
                    log.warning("no main-thread progress probe (%s): ticking from a thread", exc)
                    return None
            return cls._instance

    def ran(self) -> bool:
        """True when the main thread ran bytecode since the last request; queues the next
        request."""
        with self._asking:
            return self._ran()

    def _ran(self) -> bool:
        ran = False
        if self._queued:
            if not self.answered():
                return False  # still queued: no bytecode on the main thread since
            ran = True
        self.ask()
        return ran

    @property
    def outstanding(self) -> bool:
        """A request is queued and the main thread has not run it yet (as last seen)."""
        return self._queued

    def answered(self) -> bool:
        """True when the outstanding request has been run by the main thread (its answer
        is taken back, so nothing is outstanding after); False otherwise."""
        if self._queued and self._trywait(self._address) == 0:
            self._queued = False
            return True
        return False

    def ask(self) -> bool:
        """Queue a request unless one is outstanding; True when one was newly queued. A
        full interpreter queue refuses it: asked again at the next look."""
        if self._queued:
            return False
        self._queued = _add_pending_call(self._post, self._address) == 0
        return self._queued


class ProgressClock:
    """Owner side of the shared progress timestamps."""

    def __init__(self) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="stalwart-progress-", dir=folder)
        try:
            os.ftruncate(fd, LAYOUT.size)
            self._map = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
        now = time.monotonic()
        self._closed = False
        self._values = [now, now, 0.0, 0.0]
        self._flush()
        self._probe: MainThreadProbe | None = None

    def _flush(self) -> None:
        try:
            LAYOUT.pack_into(self._map, 0, *self._values)
        except (ValueError, TypeError):
            # The tick thread may beat once more while close() unmaps: nothing to record.
            if not self._closed:
                raise

    def tick(self) -> None:
        """Called by the tick thread every interval."""
        probe = self._probe
        if probe is not None and not probe.ran():
            return
        self._values[AUTO] = time.monotonic()
        self._flush()

    @contextlib.contextmanager
    def on_main_thread(self) -> Iterator[None]:
        """Within: the automatic tick moves only when the main thread runs bytecode (the
        wrapped function runs there). A function run on another thread keeps the
        thread's tick: pending calls run only on the main thread."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        probe = MainThreadProbe.get()
        if probe is not None:
            probe.ran()  # drop a stale answer, queue a fresh request
        self._values[AUTO] = time.monotonic()
        self._flush()
        self._probe = probe
        try:
            yield
        finally:
            self._probe = None
            self._values[AUTO] = time.monotonic()
            self._flush()

    def auto_age(self) -> float:
        """Seconds since the last automatic tick."""
        return time.monotonic() - self._values[AUTO]

    def ping(self) -> None:
        now = time.monotonic()
        self._values[MANUAL] = now
        self._values[AUTO] = now
        self._values[ARMED] = 1.0
        self._flush()

    def disarm(self) -> None:
        """Leave manual mode: wrapper phases (barriers, hooks) are not user progress."""
        self._values[ARMED] = 0.0
        self._values[AUTO] = time.monotonic()
        self._flush()

    def manual_age(self) -> float | None:
        """Seconds since the last ``ping()``, or None when not armed."""
        if not self._values[ARMED]:
            return None
        return time.monotonic() - self._values[MANUAL]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._values[CLOSED] = 1.0
        with contextlib.suppress(ValueError):
            self._flush()
            self._map.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Periodic(threading.Thread):
    """Background thread calling ``action`` every ``interval`` seconds.

    The progress tick and the store heartbeat run on separate instances, so a
    heartbeat stuck on a slow or vanished store never stops the tick that tells
    the monitor process this interpreter is alive.
    """

    def __init__(self, name: str, action: Callable[[], None], interval: float) -> None:
        super().__init__(name=f"stalwart-inprocess-{name}", daemon=True)
        self.action = action
        self.interval = interval
        self._stop_event = threading.Event()
        self._failures = 0

    def beat(self) -> None:
        try:
            self.action()
            self._failures = 0
        except Exception as exc:  # the store host may be gone; keep trying
            self._failures += 1
            if self._failures in (1, 10, 100):
                log.warning("%s failed (%d times): %s", self.name, self._failures, exc)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            # Bounded: a call stuck on an unreachable store must not hold the
            # exit; the thread is a daemon.
            self.join(timeout=max(5.0, 2 * self.interval))
