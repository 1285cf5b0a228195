"""The guardian: kills every worker and grandchild if the launcher dies without cleaning up.

The parent-death signal covers workers, but not their children (dataloader workers,
shells).  The launcher starts this small process in its own session with a pipe on its
stdin and tells it the process groups it creates (``+pgid`` / ``-pgid`` lines).  When
the pipe reaches end-of-file, which the kernel guarantees even after SIGKILL of the
launcher, the guardian SIGKILLs the groups still registered and every process that
carries the run's token in its environment (which catches descendants that left the
group with setsid), kills the job's cgroup (``!path``: the processes that also cleared
their environment; see ``cgroup.py``) and removes it, and removes the launcher's private
run-time folders (``@path`` lines), which a SIGKILLed launcher could not; then it exits.
The launcher tells it to exit only after it removed all of these itself.  It imports
nothing heavy so it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from stalwart.base import envvars
from stalwart.launch.workers.cgroup import JobCgroup

logger = logging.getLogger(__name__)

_CGROUP_LINGER = 3600.0


def processes_with_token(token: str) -> list[int]:
    """Pids whose environment has ``STALWART_RUN_TOKEN=<token>``."""
    needle = f"{envvars.RUN_TOKEN}={token}".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_tracked(tracked: dict[int, float]) -> None:
    """SIGKILLs each tracked pid that is still the process that was reported."""
    if not tracked:
        return
    import psutil  # only now: the guardian must start fast

    for pid, started in tracked.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                proc.kill()
        except psutil.Error:
            pass


def kill_everything(token: str, groups: set[int]) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    # A second sweep catches a process forked while the first one ran.
    for _ in range(2):
        for pid in processes_with_token(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class Guardian:
    """Handle on the guardian process (see ``guardian.py``)."""

    def __init__(self, token: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stalwart.launch.workers.guardian", token],
            stdin=subprocess.PIPE,
            # Not the launcher's streams: a guardian that outlives the launcher (see
            # close) must not keep its console pipes open for whoever reads them.
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if k != envvars.RUN_TOKEN},
        )
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                logger.warning("guardian process is gone; orphan protection reduced")

    def register(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def unregister(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def remove_on_death(self, path: Path) -> None:
        """*path* is removed if the launcher dies without cleaning up."""
        self._send(f"@{path}")

    def track(self, pid: int, start_time: float) -> None:
        """*pid* (started at *start_time*, which guards against pid reuse) left the
        workers' groups and is killed if the launcher dies: where no cgroup is usable."""
        self._send(f"%{pid}:{start_time!r}")

    def kill_cgroup_on_death(self, path: Path) -> None:
        """The job cgroup at *path* is killed and removed if the launcher dies."""
        self._send(f"!{path}")

    def close(self, linger: bool = False) -> None:
        """Tells the guardian the launcher cleaned up.  *linger*: something could not be
        removed yet (a job cgroup whose last process is stuck in uninterruptible sleep);
        the guardian then acts as on the launcher's death and stays until it can."""
        if linger:
            if self.proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    self.proc.stdin.close()
            return
        self._send("exit")
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m stalwart.launch.workers.guardian TOKEN", file=sys.stderr)
        return 2
    token = argv[0]
    # Terminal signals are the launcher's to handle; the guardian only acts on EOF.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    paths: set[str] = set()
    cgroups: set[str] = set()
    tracked: dict[int, float] = {}
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line == b"exit":
            return 0  # the launcher cleaned up itself
        if line[:1] == b"@" and len(line) > 1:
            paths.add(os.fsdecode(line[1:]))
        elif line[:1] == b"!" and len(line) > 1:
            cgroups.add(os.fsdecode(line[1:]))
        elif line[:1] == b"%":
            pid, _, started = line[1:].partition(b":")
            try:
                tracked[int(pid)] = float(started)
            except ValueError:
                pass
        elif len(line) > 1 and line[1:].isdigit():
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    for cg in cgroups:  # first: this also stops the job from forking any further
        JobCgroup(Path(cg)).kill_all()
    kill_everything(token, groups)
    kill_tracked(tracked)
    for cg in cgroups:
        # As long as it takes for a process in uninterruptible sleep to die (bounded).
        JobCgroup(Path(cg)).remove(timeout=_CGROUP_LINGER)
    for path in paths:  # the launcher's private run-time folders
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
