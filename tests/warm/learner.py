"""Imports a slow library and records how long that took; attempt 0 then keeps running
until told to fail; attempt 1 succeeds."""

import json
import os
import sys
import time

t0 = time.monotonic()
preloaded = "stalwart_slow_import_probe" in sys.modules
import stalwart_slow_import_probe  # noqa: E402,F401

import_s = time.monotonic() - t0
out = sys.argv[1]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
name = os.path.join(out, f"learn_{rank}_{attempt}.json")
with open(name + ".tmp", "w") as fh:
    json.dump({"preloaded": preloaded, "import_s": import_s}, fh)
os.rename(name + ".tmp", name)
if attempt == "0":
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(1)
