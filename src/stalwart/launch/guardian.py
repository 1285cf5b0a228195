"""The guardian: kills every worker and grandchild if the launcher dies without cleaning up.

The parent-death signal covers workers, but not their children (dataloader workers,
shells).  The launcher starts this small process in its own session with a pipe on its
stdin and tells it the process groups it creates (``+pgid`` / ``-pgid`` lines).  When
the pipe reaches end-of-file, which the kernel guarantees even after SIGKILL of the
launcher, the guardian SIGKILLs the groups still registered and every process that
carries the run's token in its environment (which catches descendants that left the
group with setsid), then exits.  It imports nothing heavy so it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

TOKEN_ENV = "STALWART_RUN_TOKEN"


def processes_with_token(token: str) -> list[int]:
    """Pids whose environment has ``STALWART_RUN_TOKEN=<token>``."""
    needle = f"{TOKEN_ENV}={token}".encode()
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


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m stalwart.launch.guardian TOKEN", file=sys.stderr)
        return 2
    token = argv[0]
    # Terminal signals are the launcher's to handle; the guardian only acts on EOF.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line == b"exit":
            return 0  # the launcher cleaned up itself
        if len(line) > 1 and line[1:].isdigit():
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    kill_everything(token, groups)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
