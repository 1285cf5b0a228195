"""Steps at a steady pace (argv[2] steps of argv[3] s), calling the injection hook each
step; rank 1 can instead be told (argv[4] == "hang-then-exit") to stop heartbeating and
exit on its own when the monitor asks it for stacks, so the hang report comes late."""

import os
import signal
import sys
import time

from stalwart import inject
from stalwart.monitor import RankMonitorClient
from stalwart.monitor.stacks import STACK_SIGNAL

out = sys.argv[1]
steps, pace = int(sys.argv[2]), float(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else ""
rank = os.environ["RANK"]

if mode == "hang-then-exit" and rank == "1":
    client = RankMonitorClient()
    client.init_workload_monitoring()
    for i in range(3):
        client.send_heartbeat()
        client.report_iteration(i)
    # Exits without writing stacks: the monitor is still waiting for them when the
    # supervisor sees the death, and files its report only at the teardown.
    signal.signal(STACK_SIGNAL, lambda *_: os._exit(7))
    with open(os.path.join(out, "hanging"), "w") as fh:
        fh.write(str(os.getpid()))
    while True:
        time.sleep(0.05)

for step in range(steps):
    inject.step(step)
    time.sleep(pace)
