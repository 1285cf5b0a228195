"""Imports a slow library, then ends as soon as the launcher has begun preparing a
template with it (while that template is still importing)."""

import json
import os
import sys
import time

import stalwart_slow_import_probe  # noqa: F401

events = os.environ["STALWART_EVENTS_FILE"]
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    with open(events) as fh:
        if any(json.loads(line)["event"] == "template_learn" for line in fh if line.strip()):
            break
    time.sleep(0.02)
else:
    sys.exit(3)
