"""Process primitives shared by every part of stalwart: is a pid alive, is it still the
process we started, signal it without ever hitting ourselves, and Linux's prctl knobs.

Reads /proc directly (one small read per question, cheaper than psutil for the monitor's
per-scan checks) and imports only the standard library at import time, so that the
inprocess reaper, a bare interpreter, starts in tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@functools.cache
def _libc() -> ctypes.CDLL:
    import ctypes  # on first use: the reaper, which never calls prctl, starts without it

    return ctypes.CDLL(None, use_errno=True)


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


def exists(pid: int) -> bool:
    """True while *pid* names a process table entry, a zombie included (``kill(pid, 0)``);
    one of another user counts."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parent_is(pid: int) -> bool:
    """True while this process's parent is still *pid*.  Immune to pid reuse: when a
    parent exits the kernel re-parents its children at once, before anyone reaps it."""
    return os.getppid() == pid


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

    Asked before sending the stack-dump signal: to a process without a handler it would
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


def killpg_quiet(pgid: int, sig: int) -> bool:
    """Signals a process group; False if it no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send *sig* to this process when its parent thread dies."""
    if _libc().prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_child_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init, so the
    launcher can still see (and kill) a worker's children after the worker died."""
    return bool(_libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def pdeathsig_then_check(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Set the parent-death signal and close the race where the parent already died."""
    set_parent_death_signal(sig)
    if not parent_is(expected_parent):
        os._exit(128 + int(sig))


def reap_orphans(keep: set[int]) -> list[int]:
    """Reaps exited children that are not in *keep*: as a subreaper the launcher inherits
    its workers' orphaned descendants, and must collect them or they stay zombies.
    Children in *keep* have owners (``Popen``, the worker handles) that wait for them."""
    import psutil  # here, not at import: the reaper and bootstrap start without it

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
