"""Writes through Python, through fd 1/2 directly and through a C-level child, then
optionally dies mid-line."""

import os
import signal
import sys

rank = os.environ["RANK"]
print(f"py-out rank={rank}", flush=True)
print(f"py-err rank={rank}", file=sys.stderr, flush=True)
os.write(1, f"fd-out rank={rank}\n".encode())
os.system(f"echo c-out rank={rank}")  # a separate program writing to the inherited fd
if len(sys.argv) > 1 and sys.argv[1] == "die-mid-line":
    os.write(1, f"unterminated rank={rank}".encode())
    os.kill(os.getpid(), signal.SIGKILL)
