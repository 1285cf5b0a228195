"""A training script written the way many torchrun scripts are: no
``if __name__ == "__main__":`` guard.  Every run of its body leaves a marker
(``MARKERS/r<rank>-a<attempt>-p<pid>-<__name__>``), so a test can count them.

argv: MARKERS CKPT_DIR STEPS.  Saves every 5 steps with ``AsyncCheckpointer``, resumes
with ``restore`` (from RAM under ``--ckpt-ram``), calls ``stalwart.inject.step`` each step.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart import inject
from stalwart.checkpoint import AsyncCheckpointer

markers, ckpt_dir, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ.get("RANK", "-1"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
fd = os.open(
    markers / f"r{rank}-a{attempt}-p{os.getpid()}-{__name__}", os.O_CREAT | os.O_EXCL | os.O_WRONLY
)
os.close(fd)

dist.init_process_group("gloo")
world = dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = AsyncCheckpointer(ckpt_dir, rank=rank, world_size=world)
start = 0
found = ckpt.restore(into={"model": model.state_dict(), "optim": opt.state_dict()})
if found is not None:
    start = int(found.state_dict["step"])
    model.load_state_dict(found.state_dict["model"])
    opt.load_state_dict(found.state_dict["optim"])
print(f"rank {rank} attempt {attempt} starts at step {start}", flush=True)
for step in range(start, steps):
    inject.step(step)
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()
    if (step + 1) % 5 == 0:
        ckpt.save(
            {"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1},
            step=step + 1,
        )
ckpt.close()
(markers / f"done-r{rank}-a{attempt}").write_text(str(start))
dist.destroy_process_group()
