"""Looking at and signalling worker processes by pid, read from /proc, with the guards
that keep the monitor from ever signalling itself, its own process group, or a process
that merely reused a dead worker's pid."""

from __future__ import annotations

import contextlib
import logging
import os
import signal

log = logging.getLogger(__name__)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    tail = raw[raw.rfind(")") + 2 :].split()
    return tail


def state(pid: int) -> str | None:
    """One-letter /proc state (R, S, D, T, t, Z, ...) or None when the pid is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def parent(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot; with the pid it identifies one process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def is_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (a zombie no longer runs code)."""
    st = state(pid)
    return st is not None and st not in ("Z", "X")


def is_stopped(pid: int) -> bool:
    return state(pid) in ("T", "t")


def is_descendant(pid: int, ancestor: int, max_depth: int = 16) -> bool:
    current: int | None = pid
    for _ in range(max_depth):
        if current is None or current <= 1:
            return False
        if current == ancestor:
            return True
        current = parent(current)
    return False


def signal_pid(pid: int, sig: int, group: bool = False) -> bool:
    """Sends `sig` to `pid` (or, with `group`, to the group it leads). Never to ourselves.

    Returns False when the process was already gone.
    """
    if pid <= 1 or pid == os.getpid():
        log.error("refusing to signal pid %d (self or init)", pid)
        return False
    try:
        if group and os.getpgid(pid) == pid and pid != os.getpgid(0):
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.error("not allowed to send %s to pid %d", signal_name(sig), pid)
        return False
    except OSError as exc:  # EINVAL: not a signal of this system
        log.error("cannot send signal %s to pid %d: %s", signal_name(sig), pid, exc.strerror)
        return False
    return True


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def continue_if_stopped(pid: int, group: bool = False) -> bool:
    """Resumes a SIGSTOP'd process so it can act on pending signals; True if it was stopped."""
    if not is_stopped(pid):
        return False
    with contextlib.suppress(OSError):
        signal_pid(pid, signal.SIGCONT, group=group)
    return True


def catches_signal(pid: int, sig: int) -> bool:
    """True if `pid` has a handler for `sig` (SigCgt in /proc/<pid>/status).

    Asked before sending SIGUSR1: to a process without the stack-dump handler it would
    be fatal, and whoever registered the handler (our `stacks.install` or a launcher's
    bootstrap) the kernel's view is the one that counts.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
