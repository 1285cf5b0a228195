"""Attempt 0 waits for a go file, then fails; later attempts succeed."""

import os
import sys
import time

out = sys.argv[1]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.01)
    sys.exit(1)
open(os.path.join(out, f"done_{os.environ['RANK']}"), "w").close()
