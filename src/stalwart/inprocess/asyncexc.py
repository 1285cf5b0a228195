"""Raising an exception in another thread (CPython's ``PyThreadState_SetAsyncExc``).

The exception is delivered when the target thread next runs Python bytecode, so
a thread blocked in C (a gloo collective) only sees it once that call returns;
``sockets.release_iteration_sockets`` is what makes such calls return.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


def raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> int:
    """Schedule ``exc_type`` to be raised in the thread ``thread_id``; returns the number
    of threads it was scheduled in (0: no such thread)."""
    count = int(_set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type)))
    if count > 1:
        # Affected more than one thread state: undo, as CPython's docs require.
        _set_async_exc(ctypes.c_ulong(thread_id), None)
        raise SystemError("PyThreadState_SetAsyncExc hit more than one thread")
    return count


def async_raise(
    thread_id: int, exc_type: type[BaseException], event: threading.Event | None = None
) -> None:
    """NVIDIA ``inprocess.monitor_thread``'s name: raise ``exc_type`` in ``thread_id``
    (once ``event`` is set, if given); ``RuntimeError`` if there is no such thread."""
    if event is not None:
        event.wait()
    if sys.is_finalizing():
        return
    if raise_in_thread(thread_id, exc_type) == 0:
        raise RuntimeError(f"async_raise: no running thread with id {thread_id}")


class _ReraiseUnraisable(contextlib.ContextDecorator):
    def __init__(self, exc_type: type[BaseException]) -> None:
        self.exc_type = exc_type
        self._previous: list[Callable[[Any], object]] = []

    def __enter__(self) -> None:
        previous = sys.unraisablehook
        exc_type = self.exc_type
        main_id = threading.main_thread().ident

        def hook(unraisable: Any) -> None:
            previous(unraisable)
            raised = unraisable.exc_type
            if (
                isinstance(raised, type)
                and issubclass(raised, exc_type)
                and main_id is not None
                and not sys.is_finalizing()
            ):
                # From another thread once this hook has returned: raised from here,
                # it would land in the hook's own next bytecode (or in Thread.start's
                # wait) and be reported as unraisable again.
                returned = threading.Event()
                threading.Thread(
                    target=async_raise, args=(main_id, exc_type, returned), daemon=True
                ).start()
                returned.set()

        self._previous.append(previous)
        sys.unraisablehook = hook

    def __exit__(self, *exc: object) -> None:
        sys.unraisablehook = self._previous.pop()


def reraise_if_unraisable(exc_type: type[BaseException]) -> _ReraiseUnraisable:
    """While active (a ``with`` block or a decorated function), an ``exc_type`` that
    Python could only report as unraisable (raised in a ``__del__``, a weakref callback,
    a ctypes callback) is raised again in the main thread.

    An asynchronous restart exception lands at whatever bytecode runs next; when that
    is a destructor's, Python swallows it, and the restart would be lost.
    """
    return _ReraiseUnraisable(exc_type)


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
