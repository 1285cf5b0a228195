"""Both ranks heartbeat a few times, then hang in the first attempt; the second
attempt finishes at once."""

import os
import sys
import time

from stalwart.monitor import RankMonitorClient

client = RankMonitorClient(strict=True)
client.init_workload_monitoring()
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    sys.exit(0)
for _ in range(3):
    client.send_heartbeat()
    time.sleep(0.05)
time.sleep(600)
