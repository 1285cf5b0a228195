"""Starts a grandchild, records pids, then sleeps; can ignore SIGTERM or log it."""

import os
import signal
import subprocess
import sys
import time

out_dir, mode = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]


def on_term(signum, frame):
    with open(os.path.join(out_dir, f"term_{rank}"), "w") as fh:
        fh.write(signal.Signals(signum).name)
    if mode != "ignore":
        sys.exit(0)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, on_term)
# The pids are the test's cue to signal us: only once the handlers are in place.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(out_dir, f"pids_{rank}"), "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}\n")
while True:
    time.sleep(0.1)
