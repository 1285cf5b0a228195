"""Records how long each save stalled the loop, per rank and attempt.

argv: OUT CKPT_DIR STEPS.  2 MiB of state per rank, a save every 5 steps of ~20 ms;
``stalwart.inject.step`` each step; resumes with ``restore``.  Writes
``OUT/stalls-r<rank>-a<attempt>.json``: the stall of each save, in order.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart import inject
from stalwart.checkpoint import AsyncCheckpointer


def main() -> None:
    out, ckpt_dir, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = AsyncCheckpointer(ckpt_dir, rank=rank, world_size=world)
    start = 0
    found = ckpt.restore()
    if found is not None:
        start = int(found.state_dict["step"])
        model.load_state_dict(found.state_dict["model"])
    stalls: list[float] = []
    for step in range(start, steps):
        inject.step(step)
        loss = model(torch.randn(16, 512)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.02)
        if (step + 1) % 5 == 0:
            t0 = time.monotonic()
            ckpt.save({"model": model.state_dict(), "step": step + 1}, step=step + 1)
            stalls.append(time.monotonic() - t0)
    ckpt.close()
    (out / f"stalls-r{rank}-a{attempt}.json").write_text(json.dumps(stalls))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
