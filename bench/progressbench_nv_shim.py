"""Runs an unmodified training script with NVIDIA's heartbeats added the way its docs ask
a program to send them (``RankMonitorClient.init_workload_monitoring`` once, then
``send_heartbeat`` every training step), here from torch's global optimizer post-step
hook so that the script itself stays unchanged:

    ft_launcher ... bench/progressbench_nv_shim.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
from torch.optim.optimizer import register_optimizer_step_post_hook

client = RankMonitorClient()
client.init_workload_monitoring()


def _beat(*_: Any) -> None:
    client.send_heartbeat()


register_optimizer_step_post_hook(_beat)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
client.shutdown_workload_monitoring()
