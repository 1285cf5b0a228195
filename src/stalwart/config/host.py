"""What this machine allows a launch: how many workers it can hold, whether a
``--no-python`` program can be executed, whether the run folder can be written.
``settings.LaunchConfig.validate`` asks these so a bad value is a one-line error now.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stalwart.config.values import ConfigError

# A bare interpreter with the launcher's environment needs tens of MiB; a torch worker
# hundreds.  The floor keeps a typo (99999) from making 99,999 folders and processes.
_WORKER_MEMORY = 64 << 20


def max_local_workers() -> tuple[int, str]:
    """How many workers this machine could start at all, and why that many."""
    import resource

    import psutil

    mem = psutil.virtual_memory().total
    limit = max(1, mem // _WORKER_MEMORY)
    why = f"{mem / (1 << 30):.0f} GiB of memory at {_WORKER_MEMORY >> 20} MiB per worker"
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and soft < limit:
        limit, why = max(1, soft), f"the process limit RLIMIT_NPROC is {soft}"
    return int(limit), why


def program_problem(program: str) -> str:
    """Why *program* cannot be executed ("" when it can), as ``execvp`` would find it."""
    if os.sep not in program:
        return "" if shutil.which(program) else "no such program on PATH"
    path = Path(program)
    if not path.exists():
        return "no such file"
    if path.is_dir():
        return "is a folder, expected an executable program"
    if not os.access(path, os.X_OK):
        return "not executable (chmod +x, or run it through its interpreter)"
    return ""


def check_log_dir(path: Path) -> None:
    """A one-line error now rather than a traceback when the run folder is made."""
    if str(path) == os.devnull:
        return
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--log-dir {str(path)!r}: {str(probe)!r} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--log-dir {str(path)!r}: {str(probe)!r} is not writable")
