"""A rank for the tests of what node monitors share across nodes (`stalwart run`).

``python node_worker.py OUT PLAN``: PLAN is JSON: ``steps`` (or ``seconds`` of steps),
``step`` (seconds), and
optionally ``slow_node`` with ``slow_steps`` (steps that sleep ``slow`` seconds instead)
or ``slow_factor`` (every step of that node is this many times longer), and ``until``
(a file: after ``steps``, keep stepping until it exists). Attempts after the first run
``then_steps`` plain steps. Each worker reports heartbeats and iterations as a training
script would, and writes ``done_<attempt>_<node>`` when it finishes.
"""

import json
import os
import sys
import time
from pathlib import Path

from stalwart.monitor import RankMonitorClient

out, plan = Path(sys.argv[1]), json.loads(sys.argv[2])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
node = int(os.environ["GROUP_RANK"])
# Both nodes' workers step at the same time, as a job's do (nodes start apart here).
(out / f"up_{attempt}_{node}").touch()
world = int(os.environ["GROUP_WORLD_SIZE"])
deadline = time.monotonic() + 60
while not all((out / f"up_{attempt}_{n}").exists() for n in range(world)):
    if time.monotonic() > deadline:
        sys.exit("the other node's worker never started")
    time.sleep(0.01)
client = RankMonitorClient()
client.init_workload_monitoring()
step = float(plan["step"])
slow_here = node == plan.get("slow_node", -1) and attempt == 0
slow_steps = set(plan.get("slow_steps", [])) if slow_here else set()
factor = float(plan.get("slow_factor", 1.0)) if slow_here else 1.0
steps = int(plan.get("steps", 0)) if attempt == 0 else int(plan.get("then_steps", 5))
until = Path(plan["until"]) if attempt == 0 and plan.get("until") else None
deadline = time.monotonic() + 120
if attempt == 0 and "seconds" in plan:
    steps, stop = 10**9, time.monotonic() + float(plan["seconds"])
else:
    stop = deadline
i = 0
while (i < steps and time.monotonic() < stop) or (
    until is not None and not until.exists() and time.monotonic() < deadline
):
    time.sleep(float(plan.get("slow", step)) if i in slow_steps else step * factor)
    client.send_heartbeat()
    client.report_iteration(i)
    i += 1
client.shutdown_workload_monitoring()
(out / f"done_{attempt}_{node}").write_text(str(i))
