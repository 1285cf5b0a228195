"""Worker side of stack dumps: a SIGUSR1 handler that writes every thread's Python stack.

The node monitor sends SIGUSR1 to a hung rank before terminating it. faulthandler's
handler runs in C, so it works even while the rank holds the GIL in a C call.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import IO

from stalwart.monitor import envvars

STACK_SIGNAL = signal.SIGUSR1

_installed_pid: int | None = None
# faulthandler keeps only the descriptor: the file object must outlive the registration.
_dump_file: IO[str] | None = None


def install() -> None:
    """Registers the SIGUSR1 stack dump (idempotent per process).

    The dump goes to the file named by ``STALWART_STACKS_FILE`` when the launcher set
    one (the rank's log folder), else to stderr.  The node monitor only sends SIGUSR1 to
    a process whose kernel signal mask shows a handler, since without one SIGUSR1 would
    kill it before it could say anything.
    """
    global _installed_pid, _dump_file
    pid = os.getpid()
    if _installed_pid == pid:
        return
    target: IO[str] = sys.stderr
    path = os.environ.get(envvars.STACKS_FILE)
    if path:
        try:
            if _dump_file is not None:
                _dump_file.close()
            _dump_file = target = open(path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError:
            target = sys.stderr
    faulthandler.register(STACK_SIGNAL, file=target, all_threads=True, chain=False)
    _installed_pid = pid
