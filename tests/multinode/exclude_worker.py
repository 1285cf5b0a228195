"""A rank that asks to exclude its node in attempt 0; attempt 1 records who is left.

``python exclude_worker.py OUT EXCLUDER``: in attempt 0 the worker of node EXCLUDER asks
the launcher (as NVIDIA's client does) to take its node out; the others wait to be
stopped.  In attempt 1 every worker writes ``ok_<attempt>_<group rank>`` and exits.
"""

import os
import sys
import time
from pathlib import Path

from stalwart.monitor import RankMonitorClient

out, excluder = Path(sys.argv[1]), int(sys.argv[2])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
node = int(os.environ["GROUP_RANK"])
if attempt == 0:
    (out / f"up_{node}").write_text(os.environ["WORLD_SIZE"])
    # Both nodes' workers are up before the request, so the round really ran with two.
    deadline = time.monotonic() + 60
    while not all((out / f"up_{n}").exists() for n in (0, 1)):
        if time.monotonic() > deadline:
            sys.exit("the other node's worker never started")
        time.sleep(0.02)
    if node == excluder:
        client = RankMonitorClient()
        client.init_workload_monitoring()
        client.send_workload_control_request("exclude_node")
    time.sleep(120)  # stopped by the launcher
    sys.exit("not stopped")
if (out / "hold").exists():  # keep attempt 1 running until the test says go
    deadline = time.monotonic() + 60
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
(out / f"ok_{attempt}_{node}").write_text(os.environ["WORLD_SIZE"])
