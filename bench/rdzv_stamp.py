"""A worker that records when it is ready to train: process group up and a model wrapped
in DDP (what every DDP job does first), for the rendezvous benchmark."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
with open(os.path.join(sys.argv[1], f"stamp_{os.environ['RANK']}"), "w") as fh:
    fh.write(repr(time.time()))
dist.barrier()
del ddp  # before the group goes: torch 2.13 can deadlock freeing it after
dist.destroy_process_group()
