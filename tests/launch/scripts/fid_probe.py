"""One program for both launchers: ``fid_probe.py MODE DIR`` (the side-by-side tests).

Every rank writes its torchrun variables to ``DIR/env_<rank>.json`` and one line each to
stdout and stderr.  Then, by MODE: ``ok`` ends 0; ``exit3`` ends rank 1 with code 3;
``kill`` has rank 1 SIGKILL itself; ``raise`` raises ``ValueError`` under torch's
``@record`` on rank 1; ``wait`` touches ``DIR/ready_<rank>_<attempt>`` and sleeps until
signalled (SIGUSR1: touches ``DIR/usr1_<rank>`` and ends 0); ``bare_wait`` is ``wait``
with no handler of its own (a SIGUSR1 ends it as the default action does).
Ranks that do not fail sleep (bounded) until the launcher stops them, so the failing
rank is always the root cause.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)


@record
def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])  # LOCAL_RANK is 0 everywhere with --virtual-local-rank
    env = {k: os.environ[k] for k in KEYS if k in os.environ}
    (out / f"env_{rank}.json").write_text(json.dumps(env))
    print(f"out of rank {rank}", flush=True)
    print(f"err of rank {rank}", file=sys.stderr, flush=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if mode in ("wait", "bare_wait"):
        if mode == "wait":
            # SLURM's warning before a job's time is up, as a script would catch it.
            signal.signal(signal.SIGUSR1, lambda *_: (out / f"usr1_{rank}").touch() or sys.exit(0))
        (out / f"ready_{rank}_{restart}").touch()
        time.sleep(60)
        sys.exit(9)  # never reached within the tests' time limits
    if rank != 1:
        if mode != "ok":
            time.sleep(60)  # stopped by the launcher when rank 1 fails
        return
    if mode == "exit3":
        sys.exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise":
        raise ValueError("boom from rank 1")


if __name__ == "__main__":
    main()
