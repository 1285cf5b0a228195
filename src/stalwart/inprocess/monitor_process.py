"""Starting and stopping the per-rank monitor process (the hard-timeout enforcer)."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
from pathlib import Path

from .progress import ProgressClock

log = logging.getLogger(__name__)

_SCRIPT = Path(__file__).with_name("_reaper.py")


class MonitorProcess:
    """A child interpreter that SIGTERMs (then SIGKILLs) this rank on a hard timeout."""

    def __init__(
        self,
        clock: ProgressClock,
        rank: int,
        interval: float,
        hard_timeout: float,
        grace: float,
        logfile: str | None,
    ) -> None:
        cmd = [
            sys.executable,
            "-I",  # isolated: no user site, no PYTHON* env; stdlib only, fast start
            str(_SCRIPT),
            "--parent",
            str(os.getpid()),
            "--clock",
            clock.path,
            "--rank",
            str(rank),
            "--interval",
            repr(interval),
            "--hard-timeout",
            repr(hard_timeout),
            "--grace",
            repr(grace),
        ]
        # With a log file asked for, stop() lets the child write its start line first.
        self._ready: int | None = None
        pass_fds: tuple[int, ...] = ()
        if logfile:
            self._ready, ready_w = os.pipe()
            pass_fds = (ready_w,)
            cmd += ["--logfile", logfile.format(rank=rank), "--ready-fd", str(ready_w)]
        try:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, close_fds=True, pass_fds=pass_fds
            )
        except BaseException:
            self._wait_ready(0)
            raise
        finally:
            for fd in pass_fds:
                os.close(fd)
        self.clock = clock

    def _wait_ready(self, timeout: float) -> None:
        if self._ready is None:
            return
        ready, self._ready = self._ready, None
        try:
            select.select([ready], [], [], timeout)
        finally:
            os.close(ready)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the clock and end the child now rather than at its next poll."""
        if self.proc.returncode is not None:
            self._wait_ready(0)
            return
        self._wait_ready(timeout)
        self.clock.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
