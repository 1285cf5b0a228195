"""How a worker whose program failed leaves: the shutdown a program can see, then
``os._exit``, without the interpreter's teardown.

A crashed rank is what a restart waits for.  Its teardown (clearing every module,
collecting a heap of torch objects, C++ destructors, unmapping GiBs of state) took 1.2-3.2 s
after its last atexit handler on a loaded 2-core machine, against 0.13-0.28 s from the
raise to that handler.  What the teardown does beyond the steps below is run ``__del__``
of objects still alive at exit, which Python does not promise to do.

The steps, in the interpreter's own order (``Py_FinalizeEx``):

1. a watchdog is armed: if the steps below take longer than ``bound_s`` (a non-daemon
   thread that never ends, an atexit handler that blocks), the process says which
   threads were left and exits anyway with the same status;
2. ``threading``'s shutdown: the callbacks registered with
   ``threading._register_atexit`` (``concurrent.futures`` stops its pools there, after
   their queued work), then every non-daemon thread joined;
3. the ``atexit`` handlers (``logging.shutdown`` flushes and closes the handlers there);
4. every Python file object still open flushed (the interpreter flushes them as it
   frees them), then the C library's stdio buffers (a C extension's ``printf`` to a pipe);
5. ``os._exit(status)``, or death by SIGINT after an uncaught ``KeyboardInterrupt``, as
   the interpreter does.

A worker whose program ended well (status 0) still exits through the interpreter: its
teardown is not on any restart's path, and what C++ destructors and ``__del__`` methods
write at the end of a successful run (a library's own log or trace file, a process
group's orderly close) is worth the once-per-job second or two.

Standard library only: it runs in every worker, cold or forked from the template.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

#: How long the steps may take.  The same as the launcher's default TERM -> KILL grace
#: (``--shutdown-timeout``): a crashed worker gets as long to wind down as a worker the
#: launcher stops.  The worker's environment cannot shorten it, so nothing another user
#: writes there can cut a program's shutdown short.
EXIT_BOUND_S = 30.0


@dataclass(frozen=True)
class ExitStatus:
    """What ``SystemExit(code)`` ends the process with, as the interpreter decides it."""

    status: int
    #: Printed to stderr first (a ``SystemExit`` whose code is not an integer), or None.
    message: str | None = None


def exit_status(code: object) -> ExitStatus:
    """The interpreter's reading of ``SystemExit.code``: None is 0, an integer is the
    status (the kernel keeps its low 8 bits), one that does not fit a C long is -1, and
    anything else is printed (its ``str``) and gives 1."""
    if code is None:
        return ExitStatus(0)
    if isinstance(code, int):
        # bool included, as there; a C long is 64 bits on the Linux we run on.
        if not -(2**63) <= code < 2**63:
            return ExitStatus(-1 & 0xFF)
        return ExitStatus(code & 0xFF)
    try:
        return ExitStatus(1, str(code))
    except Exception:
        # The interpreter prints an empty line for a code whose str() raises.
        return ExitStatus(1, "")


def shut_down_and_exit(
    status: int, *, interrupted: bool = False, bound_s: float = EXIT_BOUND_S
) -> NoReturn:
    """Steps 1-5 of the module's docstring; never returns."""
    # A signal handler can only be set from the main thread, which is the one the
    # watchdog gives up on: it exits with the shell's status for SIGINT instead.
    _arm_watchdog(128 + signal.SIGINT if interrupted else status, bound_s)
    _threading_shutdown()
    atexit._run_exitfuncs()
    _flush_python_files()
    _flush_c_stdio()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _arm_watchdog(status: int, bound_s: float) -> None:
    def expire() -> None:
        time.sleep(bound_s)
        left = [t.name for t in threading.enumerate() if not t.daemon and t.is_alive()]
        line = (
            f"stalwart: the program's shutdown after its failure took over {bound_s:g} s; "
            f"exiting without it (non-daemon threads left: {', '.join(left) or 'none'})\n"
        )
        # os.write: sys.stderr's lock may be held by the thread we give up on.
        os.write(2, line.encode("utf-8", "replace"))
        os._exit(status)

    threading.Thread(target=expire, name="stalwart-exit-watchdog", daemon=True).start()


def _threading_shutdown() -> None:
    # The interpreter's own step, private but present in every CPython we support
    # (3.11-3.13); it marks the main thread stopped, so it runs once.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    # The same two steps by hand: the callbacks first, or a pool's workers wait on
    # their queue forever while we join them.
    for callback in reversed(getattr(threading, "_threading_atexits", [])):
        callback()
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()


#: What ``open()`` returns for writing.  Exact types: an ``isinstance`` against io's
#: abstract classes walks each object's class hierarchy (1 s over a torch process's heap).
_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _flush_python_files() -> None:
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    # A warm worker's template froze its heap: get_objects() skips the frozen objects,
    # which are the template's, not the program's files.
    for obj in gc.get_objects():
        if type(obj) in _BUFFERED:
            _flush(obj)


def _flush(stream: object) -> None:
    try:
        if not getattr(stream, "closed", False):
            stream.flush()  # type: ignore[attr-defined]
    except Exception:
        # As the interpreter at exit: a stream that cannot flush (closed pipe, full
        # disk, a program's own object without flush) does not stop the others.
        pass


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (ImportError, OSError, AttributeError):
        pass
