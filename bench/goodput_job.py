"""The goodput benchmark's job: a small DDP training loop (gloo) that resumes from its
own checkpoint and logs each step's start and end, so productive time can be computed
without the launcher.  argv: OUT STEPS EVERY"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from stalwart import inject, runlog

out, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ckpt = os.path.join(out, "ckpt.pt")
dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt, weights_only=True)
    net.load_state_dict(state["model"])
    start = int(state["step"])
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(256, 256), torch.randn(256, 1)
with open(os.path.join(out, f"times_{attempt}_{rank}.jsonl"), "a") as log:
    for step in range(start, steps):
        t0 = time.time()
        inject.step(step)
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if rank == 0 and (step + 1) % every == 0:
            torch.save({"model": net.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            runlog.emit(runlog.CHECKPOINT_COMMIT, step=step + 1)
        log.write(json.dumps({"step": step, "start": t0, "end": time.time()}) + "\n")
dist.destroy_process_group()
