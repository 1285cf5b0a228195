"""A gloo job that fails on purpose until the given attempt, then succeeds.

Each attempt forms a real process group and runs an all_reduce, so a restart only works
if the restarted ranks find each other (not a dead peer's address).
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

fail_until = int(sys.argv[1])
out_dir = sys.argv[2]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
with open(os.path.join(out_dir, f"ok_{attempt}_{rank}"), "w") as fh:
    fh.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt < fail_until and rank == attempt % world:
    sys.exit(5)
dist.barrier()
dist.destroy_process_group()
