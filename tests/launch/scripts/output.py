"""Writes through Python, through fd 1/2 directly and through a C-level child, then
optionally dies mid-line."""

import os
import signal
import sys
import time

rank = os.environ["RANK"]
print(f"py-out rank={rank}", flush=True)
print(f"py-err rank={rank}", file=sys.stderr, flush=True)
os.write(1, f"fd-out rank={rank}\n".encode())
os.system(f"echo c-out rank={rank}")  # a separate program writing to the inherited fd
if len(sys.argv) > 1 and sys.argv[1] == "die-mid-line":
    os.write(1, f"unterminated rank={rank}".encode())
    # Every rank writes its partial line before any dies: the launcher tears the job down
    # at the first death, which would cut off a rank that has not written yet.  Being
    # killed while waiting here is fine: this rank's line is written already.
    ready = sys.argv[2]
    os.makedirs(ready, exist_ok=True)
    with open(os.path.join(ready, f"ready_{rank}"), "w"):
        pass
    peers = [os.path.join(ready, f"ready_{r}") for r in range(int(os.environ["WORLD_SIZE"]))]
    deadline = time.monotonic() + 20
    while not all(os.path.exists(p) for p in peers) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
