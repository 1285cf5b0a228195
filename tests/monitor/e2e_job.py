"""A 2-rank gloo job for the end-to-end monitor tests, run by `stalwart run`.

`python e2e_job.py MODE STEPS [PAUSE]`: on the first attempt rank 1 hangs at step 5 in the way
MODE names; after the restart every rank runs all steps and the job succeeds. PAUSE
(seconds, default 0.02) is slept after each step.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from stalwart.monitor import RankMonitorClient, timer


def hang(mode: str) -> None:
    if mode == "sleep":
        time.sleep(600)
    elif mode == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "gil":
        ctypes.PyDLL(None).sleep(600)
    elif mode == "timer":
        with timer.expires(after=1.5, scope="stuck_step"):
            time.sleep(600)
    elif mode == "shutdown":
        client.send_workload_control_request("shutdown_workload")
        time.sleep(600)
    elif mode == "section":
        with client.section("step"):
            time.sleep(600)


mode, steps = sys.argv[1], int(sys.argv[2])
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.02
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
client = RankMonitorClient(strict=True)
client.init_workload_monitoring()
for step in range(steps):
    if attempt == 0 and rank == 1 and step == 5 and mode != "peer_sleeps":
        hang(mode)
    with client.section("step"):
        dist.all_reduce(torch.ones(4))
    if attempt == 0 and rank == 1 and step == 5 and mode == "peer_sleeps":
        # Asleep after the step's collective, before its heartbeat (as a Lightning
        # callback would be): rank 0 reports step 5 and blocks in step 6 waiting for it.
        time.sleep(600)
    client.send_heartbeat()
    client.report_iteration(step)
    time.sleep(pause)
client.shutdown_workload_monitoring()
dist.destroy_process_group()
print(f"rank {rank} finished attempt {attempt}", flush=True)
