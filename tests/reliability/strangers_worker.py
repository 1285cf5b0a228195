"""A gloo worker that never imports stalwart and has no ``__main__`` guard: it writes
what of the job's secret its environment shows (its own and a child's), says it is up,
then waits for a go file before finishing."""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
child = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout
seen = [
    line
    for text in (Path("/proc/self/environ").read_bytes().decode(errors="replace"), child)
    for line in text.replace("\0", "\n").splitlines()
    if "JOB_SECRET" in line and not line.startswith("STALWART_JOB_SECRET_FILE")
]
(out / f"secret_seen_{rank}").write_text("\n".join(seen))
(out / f"ready_{rank}").write_text(str(os.getpid()))
deadline = time.monotonic() + 90
while not (out / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(f"rank {rank}: no go file within 90s")
    time.sleep(0.02)
dist.barrier()
dist.destroy_process_group()
