"""``stalwart run`` whose main thread swallows the exception of the first SIGINT.

``python swallowing_launcher.py CLASS OUT_DIR RUN_ARGS...``: once both workers of
``sleeper.py OUT_DIR ...`` have written their pids, the supervisor's per-round progress
call sends SIGINT to the launcher itself inside ``try: ... except CLASS: pass`` (CLASS is
``Exception`` or ``BaseException``), as a library or a logging handler that catches
everything would, had the signal arrived while it ran.
"""

import os
import signal
import sys
from pathlib import Path

from stalwart import cli
from stalwart.launch.round.attempt import AttemptWorkers

caught = {"Exception": Exception, "BaseException": BaseException}[sys.argv[1]]
out = Path(sys.argv[2])
original = AttemptWorkers.emit_progress
fired = []


def _workers_up() -> bool:
    files = list(out.glob("pids_*"))
    return len(files) == 2 and all(f.read_text().endswith("\n") for f in files)


def swallowing(self, *args, **kwargs):
    original(self, *args, **kwargs)
    if fired or not _workers_up():
        return
    fired.append(True)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        # The handler runs at the next bytecode boundary: still inside this try.
        for _ in range(100_000):
            pass
    except caught:
        (out / "swallowed").touch()


AttemptWorkers.emit_progress = swallowing
sys.exit(cli.main(sys.argv[3:]))
