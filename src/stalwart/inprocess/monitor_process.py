"""Starting and stopping the per-rank monitor process (the hard-timeout enforcer)."""

from __future__ import annotations

import contextlib
import logging
import os
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
        if logfile:
            cmd += ["--logfile", logfile.format(rank=rank)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True)
        self.clock = clock

    def stop(self, timeout: float = 5.0) -> None:
        """Close the clock and end the child now rather than at its next poll."""
        if self.proc.returncode is not None:
            return
        self.clock.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
