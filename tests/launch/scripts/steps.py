"""A torch-free loop that calls the injection hook each step and logs progress."""

import os
import sys

from stalwart import inject

out = sys.argv[1]
rank = os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
for step in range(int(sys.argv[2]) if len(sys.argv) > 2 else 10):
    inject.step(step)
    with open(os.path.join(out, f"steps_{attempt}_{rank}"), "a") as fh:
        fh.write(f"{step}\n")
