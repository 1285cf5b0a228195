"""Raising an exception in another thread (CPython's ``PyThreadState_SetAsyncExc``).

The exception is delivered when the target thread next runs Python bytecode, so
a thread blocked in C (a gloo collective) only sees it once that call returns;
``sockets.release_iteration_sockets`` is what makes such calls return.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Callable
from types import FrameType

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


def raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> None:
    """Schedule ``exc_type`` to be raised in the thread ``thread_id``."""
    count = _set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type))
    if count > 1:
        # Affected more than one thread state: undo, as CPython's docs require.
        _set_async_exc(ctypes.c_ulong(thread_id), None)
        raise SystemError("PyThreadState_SetAsyncExc hit more than one thread")


def clear_pending(thread_id: int) -> None:
    """Drop an exception scheduled for ``thread_id`` that was not delivered yet."""
    _set_async_exc(ctypes.c_ulong(thread_id), None)


# A thread blocked in an interruptible system call (``time.sleep``, ``select``)
# runs no bytecode, so the async exception would wait there.  A signal makes the
# call return EINTR and run the (empty) Python handler, whose first bytecode
# delivers the pending exception.  A real-time signal, to stay clear of SIGUSR1/2.
WAKE_SIGNAL = signal.SIGRTMIN + 3


def _on_wake(signum: int, frame: FrameType | None) -> None:
    del signum, frame  # the pending async exception is raised on entry


def install_wake_handler() -> Callable[[], None]:
    """Install the wake handler (main thread only); returns a function that restores the old one."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(WAKE_SIGNAL, _on_wake)

    def restore() -> None:
        signal.signal(WAKE_SIGNAL, previous)

    return restore


def wake(thread_id: int) -> None:
    """Interrupt a blocking system call in ``thread_id`` so a pending exception lands."""
    if signal.getsignal(WAKE_SIGNAL) is not _on_wake:
        return
    with contextlib.suppress(ProcessLookupError, OSError):
        signal.pthread_kill(thread_id, WAKE_SIGNAL)
