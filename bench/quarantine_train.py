"""The quarantine benchmark's job: a short gloo loop; on the node started with
QUARANTINE_BAD the rank dies at step ``--bad-step`` of every attempt."""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--bad-step", type=int, default=5)
p.add_argument("--step-s", type=float, default=0.02)
a = p.parse_args()
dist.init_process_group("gloo")
t = torch.ones(1024)
for step in range(a.steps):
    if os.environ.get("QUARANTINE_BAD") and step == a.bad_step:
        sys.exit(7)
    dist.all_reduce(t)
    time.sleep(a.step_s)
dist.destroy_process_group()
