# A DDP script that never imports stalwart and has no __main__ guard. In attempt 0,
# rank 1 stops itself (SIGSTOP) at step PJ_STOP_AT while rank 0 waits for it in a
# barrier; should the two ever get past that barrier in attempt 0 (rank 1 continued),
# both sit in `resumed_past_the_barrier`, so a stack taken then names that function.
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


note("start")
for step in range(steps):
    if attempt == 0 and step == stop_at:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        waiting_for_rank_1()
        resumed_past_the_barrier()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)
note("end")
dist.destroy_process_group()
