"""A torch-free training loop that resumes from a checkpoint file and logs its own
per-step timestamps, so the launcher's accounting can be checked independently.

argv: OUT STEPS STEP_SECONDS [CKPT_EVERY]
"""

import json
import os
import sys
import time

from stalwart import inject, runlog

out, steps, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
every = int(sys.argv[4]) if len(sys.argv) > 4 else 5
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ckpt = os.path.join(out, "ckpt")
start = 0
if os.path.exists(ckpt):
    with open(ckpt) as fh:
        start = int(fh.read())
log = open(os.path.join(out, f"times_{attempt}_{rank}.jsonl"), "a")  # noqa: SIM115
for step in range(start, steps):
    t0 = time.time()
    inject.step(step)
    time.sleep(step_s)
    log.write(json.dumps({"step": step, "start": t0, "end": time.time()}) + "\n")
    log.flush()
    if rank == 0 and (step + 1) % every == 0:
        with open(ckpt + ".tmp", "w") as fh:
            fh.write(str(step + 1))
        os.replace(ckpt + ".tmp", ckpt)
        runlog.emit(runlog.CHECKPOINT_COMMIT, step=step + 1)
