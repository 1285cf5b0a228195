"""The node-health goodput benchmark's job: a small DDP loop on gloo that never imports
stalwart (its steps are seen through the optimizer) and has no ``__main__`` guard.
argv: OUT STEPS.  Each worker appends a line to ``starts_<host>`` as it starts (attempts,
counted the same under any launcher) and, when it finished every step, writes
``done_<rank>.json`` with its first step's start and its last step's end.  On the node
started with HEALTHBENCH_BAD=1 the worker exits 7 at step 5 of every attempt."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

out, steps = sys.argv[1], int(sys.argv[2])
with open(os.path.join(out, f"starts_{os.environ.get('HEALTHBENCH_HOST', 'x')}"), "a") as fh:
    fh.write(f"{time.time()}\n")
dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(2048, 256), torch.randn(2048, 1)
bad = os.environ.get("HEALTHBENCH_BAD") == "1"
first = None
for step in range(steps):
    if first is None:
        first = time.time()
    if bad and step == 5:
        sys.exit(7)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
done = {"start": first, "end": time.time(), "world": dist.get_world_size()}
with open(os.path.join(out, f"done_{os.environ['RANK']}.json"), "w") as fh:
    json.dump(done, fh)
del model  # before the group goes: torch 2.13 can deadlock freeing it after
dist.destroy_process_group()
