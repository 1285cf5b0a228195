# A DDP script that never imports stalwart and has no __main__ guard. In attempt 0,
# rank 1 stops itself (SIGSTOP) at step PJ_STOP_AT while rank 0 waits for it in a
# barrier; should the two ever get past that barrier in attempt 0 (rank 1 continued),
# both sit in `resumed_past_the_barrier`, so a stack taken then names that function.
# In attempt 1, at step PJ_EVAL_AT, every rank runs an evaluation pass of PJ_EVAL_SECONDS
# whose batches each wait on a slow data source (little CPU, no optimizer step): healthy.
# p.jsonl (rank 0) gets a line per attempt start and at the end.
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

work = os.environ["PJ_WORK"]
steps = int(os.environ.get("PJ_STEPS", "60"))
stop_at = int(os.environ.get("PJ_STOP_AT", "40"))
eval_at = int(os.environ.get("PJ_EVAL_AT", "30"))
eval_seconds = float(os.environ.get("PJ_EVAL_SECONDS", "3"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def note(event):
    if rank == 0:
        with open(os.path.join(work, "p.jsonl"), "a") as f:
            f.write(json.dumps({"event": event, "attempt": attempt, "time": time.time()}) + "\n")


def waiting_for_rank_1():
    dist.barrier()


def resumed_past_the_barrier():
    while True:
        time.sleep(0.05)


def evaluate():
    end = time.monotonic() + eval_seconds
    with torch.no_grad():
        while time.monotonic() < end:
            time.sleep(0.05)  # the next batch from slow storage
            model.module(torch.randn(64, 8)).sum().item()
    note("evaluated")


note("start")
for step in range(steps):
    if attempt == 0 and step == stop_at:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        waiting_for_rank_1()
        resumed_past_the_barrier()
    if attempt == 1 and step == eval_at:
        evaluate()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)
note("end")
dist.destroy_process_group()
