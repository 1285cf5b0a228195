"""A per-job cgroup (v2): every process the job starts stays in it, whatever it does.

A worker's child can leave the worker's process group (``setsid``), clear its
environment (``env -i``) and double-fork; only the kernel still knows it belongs to the
job: it stays in the cgroup it was born in.  The launcher creates
``<its own cgroup>/stalwart-<token>`` when cgroup v2 is mounted and writable, workers
enter it before they run anything (so their descendants are born in it), and the
job's end writes ``cgroup.kill``.  The guardian knows the folder too, so a SIGKILLed
launcher's job is killed and the folder removed all the same.

Without a usable cgroup (no v2 mount, no permission, a parent cgroup with controllers
that forbids member processes) ``JobCgroup.create`` returns None and the launcher falls
back on what a child subreaper sees.  ``STALWART_CGROUP=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.base import envvars

logger = logging.getLogger(__name__)

_PREFIX = "stalwart-"


def _v2_mount(mountinfo: str) -> Path | None:
    """Mount point of the cgroup2 hierarchy in ``/proc/self/mountinfo`` text."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            fields = left.split()
            if len(fields) >= 5:
                return Path(fields[4])
    return None


def _own_path(proc_cgroup: str) -> str | None:
    """This process's v2 cgroup (the ``0::/path`` line of ``/proc/self/cgroup``)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def _parent_dir() -> Path | None:
    try:
        mount = _v2_mount(Path("/proc/self/mountinfo").read_text())
        own = _own_path(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    if mount is None or own is None:
        return None
    return mount / own.lstrip("/")


class JobCgroup:
    """Handle on the job's cgroup folder."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(
        cls, token: str, announce: Callable[[Path], object] | None = None
    ) -> JobCgroup | None:
        """A fresh cgroup for the job, or None where cgroup v2 cannot be used.
        *announce* learns the folder before it exists (the guardian: so that no moment
        is left where a SIGKILL would leave it behind)."""
        if os.environ.get(envvars.CGROUP, "1").lower() in ("0", "false", "no"):
            return None
        parent = _parent_dir()
        if parent is None or not (parent / "cgroup.procs").exists():
            return None
        path = parent / f"{_PREFIX}{token}"
        if announce is not None:
            announce(path)
        try:
            path.mkdir(mode=0o755)
        except OSError as err:
            logger.debug("no job cgroup under %s (%s); using the subreaper only", parent, err)
            return None
        cg = cls(path)
        # Where the parent enables controllers, no process may join a child of it
        # (cgroup v2's no-internal-process rule for threaded/domain controllers): a
        # short-lived probe proves that joining works before anyone relies on it.
        if not cg._probe():
            cg.remove(timeout=1.0)
            return None
        return cg

    def _probe(self) -> bool:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 0 if self.join() else 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0

    def join(self, pid: int = 0) -> bool:
        """Moves *pid* (0: the calling process) into the cgroup.  Safe in a pre-exec hook:
        plain ``os`` calls only."""
        try:
            fd = os.open(self.path / "cgroup.procs", os.O_WRONLY)
        except OSError:
            return False
        try:
            os.write(fd, str(pid).encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split()]

    def kill_except(self, spare: set[int], rounds: int = 20) -> list[int]:
        """SIGKILLs every member but *spare* (the warm template serves the next attempt).
        Repeats while new members appear (a process forking while it is being killed)."""
        killed: list[int] = []
        for _ in range(rounds):
            victims = [p for p in self.pids() if p not in spare and p not in killed]
            if not victims:
                break
            for pid in victims:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return killed

    def kill_all(self) -> None:
        """Kills every member at once (``cgroup.kill``, Linux 5.14+; a loop before)."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            self.kill_except(set())

    def populated(self) -> bool:
        try:
            for line in (self.path / "cgroup.events").read_text().splitlines():
                if line.startswith("populated "):
                    return line.split()[1] != "0"
        except OSError:
            return bool(self.pids())
        return bool(self.pids())

    def remove(self, timeout: float = 5.0) -> bool:
        """Kills what is left and removes the folder (possible only once it is empty:
        killed processes leave it when they are reaped)."""
        if not self.path.exists():
            return True
        self.kill_all()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() > deadline:
                    logger.warning("job cgroup %s still busy; left in place", self.path)
                    return False
                time.sleep(0.01 if timeout <= 5.0 else 0.1)
