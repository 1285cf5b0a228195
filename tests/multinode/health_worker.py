"""A worker for the node-health tests: one gloo all-reduce over every rank of the round,
then rank 0 writes the world size and the sum it got (no __main__ guard, on purpose)."""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 0:
    Path(sys.argv[1], "world").write_text(f"{dist.get_world_size()} {int(t.item())}")
dist.destroy_process_group()
os._exit(0)
