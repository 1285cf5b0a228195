# A healthy 2-rank DDP job with slow phases, as found in real training scripts: no
# stalwart import, no __main__ guard. Used by bench/bench_progress_hang.py
# --healthy-minutes. Nothing in it hangs; a kill is a false kill.
#   PJ_WORK     folder for rank 0's p.jsonl (one line per phase) and the checkpoint
#   PJ_SECONDS  how long to train (default 600)
#   PJ_PHASE    steps between slow phases (default 300); phases alternate between an
#               evaluation pass (every rank: batches of forward passes, each behind a
#               data-loading wait) and a checkpoint (rank 0 writes and fsyncs the state
#               in chunks, as to slow storage, while rank 1 waits in a barrier); each
#               lasts a random 3-8 s.
#   PJ_FIRST    the first slow phase: eval (default) or checkpoint
# Steps vary: 10-60 ms of data loading (sleep) around a small forward/backward, and one
# step in 50 takes 0.2-0.4 s (a slow batch). Sleep-dominated: light on a shared machine.
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

work = os.environ["PJ_WORK"]
seconds = float(os.environ.get("PJ_SECONDS", "600"))
phase_every = int(os.environ.get("PJ_PHASE", "300"))
dist.init_process_group("gloo")
rank = dist.get_rank()
rng = random.Random(1234 + rank)
phase_rng = random.Random(99)  # the same on every rank: phases line up
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def note(**rec):
    if rank == 0:
        with open(os.path.join(work, "p.jsonl"), "a") as f:
            f.write(json.dumps({**rec, "time": time.time()}) + "\n")


def evaluate(duration):
    end = time.monotonic() + duration
    with torch.no_grad():
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.02, 0.08))  # the loader's next batch
            model.module(torch.randn(512, 64)).sum().item()


def checkpoint(duration):
    if rank == 0:
        path = os.path.join(work, "ckpt.pt")
        state = {"model": model.module.state_dict(), "opt": opt.state_dict()}
        end = time.monotonic() + duration
        with open(path + ".tmp", "wb") as f:
            while time.monotonic() < end:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
                time.sleep(0.05)  # a throttled store between chunks
        os.replace(path + ".tmp", path)
    dist.barrier()


note(event="start")
start = time.monotonic()
step = 0
phases = 0 if os.environ.get("PJ_FIRST", "eval") == "eval" else 1
while time.monotonic() - start < seconds:
    time.sleep(rng.uniform(0.01, 0.06) if rng.random() > 0.02 else rng.uniform(0.2, 0.4))
    loss = model(torch.randn(32, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step % phase_every == 0:
        duration = phase_rng.uniform(3.0, 8.0)
        kind = "eval" if phases % 2 == 0 else "checkpoint"
        t0 = time.monotonic()
        (evaluate if kind == "eval" else checkpoint)(duration)
        phases += 1
        note(event=kind, step=step, seconds=time.monotonic() - t0)
note(event="end", step=step)
dist.destroy_process_group()
