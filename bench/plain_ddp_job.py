# A plain DDP training script as found in tutorials: no stalwart import, no __main__
# guard, a checkpoint it resumes from. Test knobs come from PJ_* variables:
#   PJ_WORK     folder for the checkpoint and rank 0's p.jsonl (one JSON line a step)
#   PJ_STEPS    optimizer steps in all (default 60)
#   PJ_FAULT    kind:rank:step[:attempt] (attempt 0 unless given): sleep (the program's
#               own code sleeps before the step's collective), stop (SIGSTOP to itself),
#               loader (its Dataset blocks while fetching), none
# Rank 0's p.jsonl lines carry the wall-clock time of each step (benchmarks time by it).
# Used by tests/reliability/test_progress_hangs.py and bench/bench_progress_hang.py.
#   PJ_EVAL     every N steps an evaluation pass 10x a step long (0: none)
#   PJ_CKPT     every N steps a checkpoint (default 10)
#   PJ_SLEEP    extra seconds per step (default 0)
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

work = os.environ["PJ_WORK"]
steps = int(os.environ.get("PJ_STEPS", "60"))
kind, frank, fstep, fattempt = [*os.environ.get("PJ_FAULT", "none:0:0").split(":"), "0"][:4]
every_eval = int(os.environ.get("PJ_EVAL", "0"))
every_ckpt = int(os.environ.get("PJ_CKPT", "10"))
step_sleep = float(os.environ.get("PJ_SLEEP", "0"))  # extra seconds per step (data, logging)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
rank = dist.get_rank()
faulty = attempt == int(fattempt) and rank == int(frank) and kind != "none"
torch.manual_seed(0)


class Numbers(Dataset):
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        if faulty and kind == "loader" and state["step"] >= int(fstep):
            while True:
                time.sleep(3600)
        return torch.randn(16), torch.randn(1)


state = {"step": 0}
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ckpt = os.path.join(work, "ckpt.pt")
if os.path.exists(ckpt):
    saved = torch.load(ckpt, weights_only=True)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state["step"] = saved["step"]
if rank == 0:
    with open(os.path.join(work, "p.jsonl"), "a") as f:
        f.write(
            json.dumps(
                {"event": "start", "attempt": attempt, "step": state["step"], "time": time.time()}
            )
            + "\n"
        )
data = iter(DataLoader(Numbers(), batch_size=8))
while state["step"] < steps:
    if faulty and state["step"] == int(fstep):
        if kind == "sleep":
            while True:
                time.sleep(3600)
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
    x, y = next(data)
    if step_sleep:
        time.sleep(step_sleep)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    state["step"] += 1
    t0 = time.perf_counter()
    if every_eval and state["step"] % every_eval == 0:
        with torch.no_grad():
            while time.perf_counter() - t0 < 0.5:
                model.module(torch.randn(256, 16))
    if every_ckpt and state["step"] % every_ckpt == 0 and rank == 0:
        tmp = ckpt + ".tmp"
        torch.save(
            {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": state["step"]},
            tmp,
        )
        os.replace(tmp, ckpt)
    if every_ckpt and state["step"] % every_ckpt == 0:
        dist.barrier()
    if rank == 0:
        with open(os.path.join(work, "p.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "event": "step",
                        "attempt": attempt,
                        "step": state["step"],
                        "time": time.time(),
                    }
                )
                + "\n"
            )
dist.destroy_process_group()
