# A job that makes progress, then fails the same way at a later step in each attempt:
# it resumes from its own checkpoint file, so every restart gets further.
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import stalwart.inject

state = Path(sys.argv[1]) / f"step.{os.environ['RANK']}"
start = int(state.read_text()) if state.exists() else 0
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
crash_at = start + 3  # each attempt gets 3 steps further than the last
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(start, 12):
    loss = model(torch.ones(2, 4)).sum()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    stalwart.inject.step(step)
    state.write_text(str(step + 1))
    if attempt < int(sys.argv[2]) and step + 1 == crash_at and os.environ["RANK"] == "1":
        raise RuntimeError("bad batch")
dist.destroy_process_group()
