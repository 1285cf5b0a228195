"""A worker for the quarantine test: the rank on the node started with QUARANTINE_CRASH
fails every attempt once its peers are connected (so it is the round's root cause);
the others train a few steps and finish.  It writes ``done_<attempt>_<rank>`` when it
completes, so the test sees which attempt finished and with how many ranks."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo")
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
t = torch.ones(4)
dist.all_reduce(t)
if os.environ.get("QUARANTINE_CRASH"):
    sys.exit(7)
for _ in range(10):
    dist.all_reduce(t)
    time.sleep(0.02)
(out / f"done_{attempt}_{dist.get_rank()}").write_text(str(dist.get_world_size()))
dist.destroy_process_group()
