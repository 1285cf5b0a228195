"""A gloo worker that says it is up, then waits for a go file before finishing."""

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
(out / f"ready_{rank}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not (out / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(f"rank {rank}: no go file within 60s")
    time.sleep(0.02)
dist.barrier()
dist.destroy_process_group()
