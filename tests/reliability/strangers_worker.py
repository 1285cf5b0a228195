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
# What it gets instead: a key for its in-process records only, in a file of its own.
key_file = os.environ.get("STALWART_WORKER_KEY_FILE", "")
mode = oct(os.stat(key_file).st_mode & 0o777) if key_file else "none"
(out / f"key_mode_{rank}").write_text(mode)
(out / f"ready_{rank}").write_text(str(os.getpid()))
deadline = time.monotonic() + 90
while not (out / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(f"rank {rank}: no go file within 90s")
    time.sleep(0.02)
dist.barrier()
dist.destroy_process_group()
