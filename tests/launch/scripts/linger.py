"""Steps with the injection hook; every rank but 0 ignores SIGTERM, so a teardown
after rank 0's crash takes the launcher's whole --shutdown-timeout.  Rank 0 steps
only once rank 1 ignores SIGTERM (argv: a folder for the marker file)."""

import os
import signal
import sys
import time

from stalwart import inject

marker = os.path.join(sys.argv[1], "ignoring")
if os.environ["RANK"] != "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(marker, "w").close()
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
for step in range(100000):
    inject.step(step)
    time.sleep(0.02)
