"""A torch-free worker that reports a step every 50 ms until a go file appears.

argv: OUT
"""

import sys
import time
from pathlib import Path

from stalwart import inject

out = Path(sys.argv[1])
deadline = time.monotonic() + 150
step = 0
while not (out / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("no go file within 150 s")
    inject.step(step)
    step += 1
    time.sleep(0.05)
