"""Worker side of stack dumps: a signal handler that writes every thread's Python stack.

The node monitor sends `STACK_SIGNAL` to a hung rank before terminating it. faulthandler's
handler runs in C, so it works even while the rank holds the GIL in a C call.

`STACK_SIGNAL` is a real-time signal, not SIGUSR1: a worker must treat SIGUSR1 exactly as
it would under torchrun (no handler unless the program installs one, so a forwarded
SIGUSR1 ends it at once), and a program's own SIGUSR1 handler (Lightning's SLURM requeue,
for one) must never be set off by a hang.  Send it by hand with
``kill -s RTMIN+4 PID`` (the number is glibc's SIGRTMIN plus 4).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import IO

from stalwart.monitor import envvars

# SIGRTMIN+3 is the in-process restart's wake-up signal (inprocess/asyncexc.py).
STACK_SIGNAL = signal.SIGRTMIN + 4

_installed_pid: int | None = None
# faulthandler keeps only the descriptor: the file object must outlive the registration.
_dump_file: IO[str] | None = None


def install() -> None:
    """Registers the `STACK_SIGNAL` stack dump (idempotent per process).

    The dump goes to the file named by ``STALWART_STACKS_FILE`` when the launcher set
    one (the rank's log folder), else to stderr.  The node monitor only sends the signal to
    a process whose kernel signal mask shows a handler, since without one it would kill
    the process before it could say anything.
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
