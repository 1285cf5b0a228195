"""Worker side of stack dumps: a SIGUSR1 handler that writes every thread's Python stack.

The node monitor sends SIGUSR1 to a hung rank before terminating it. faulthandler's
handler runs in C, so it works even while the rank holds the GIL in a C call.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

STACK_SIGNAL = signal.SIGUSR1

_installed_pid: int | None = None


def install() -> None:
    """Registers the SIGUSR1 stack dump to stderr (idempotent per process).

    The node monitor only sends SIGUSR1 to a process whose kernel signal mask shows a
    handler, since without one SIGUSR1 would kill it before it could say anything.
    """
    global _installed_pid
    pid = os.getpid()
    if _installed_pid == pid:
        return
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    _installed_pid = pid


def is_installed() -> bool:
    """True when this very process registered the handler (a fork must install again)."""
    return _installed_pid == os.getpid()
