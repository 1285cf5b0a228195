"""A job that never imports stalwart (nor torch) and has no ``__main__`` guard.  In the
first attempt rank 2 exits 1 once ranks 0 and 1 are ready; rank 0 ignores SIGTERM,
rank 1's handler uses 0.3 s of its grace, writes its file and exits 0.  Every rank of a
later attempt exits 0 at once (argv: a folder for the files)."""

import os
import signal
import sys
import time

folder = sys.argv[1]
rank = int(os.environ["RANK"])
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    sys.exit(0)


def save_then_exit(signum, frame):
    time.sleep(0.3)
    with open(os.path.join(folder, "saved"), "w") as fh:
        fh.write("done")
    sys.exit(0)


if rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif rank == 1:
    signal.signal(signal.SIGTERM, save_then_exit)
deadline = time.monotonic() + 60
if rank == 2:
    ready = [os.path.join(folder, f"ready{r}") for r in (0, 1)]
    while not all(map(os.path.exists, ready)) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(1)
open(os.path.join(folder, f"ready{rank}"), "w").close()
while time.monotonic() < deadline:
    time.sleep(0.05)
