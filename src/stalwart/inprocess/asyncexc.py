"""Raising an exception in another thread (CPython's ``PyThreadState_SetAsyncExc``).

The exception is delivered when the target thread next runs Python bytecode, so
a thread blocked in C (a gloo collective) only sees it once that call returns;
``sockets.release_iteration_sockets`` is what makes such calls return.
"""

from __future__ import annotations

import ctypes

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
