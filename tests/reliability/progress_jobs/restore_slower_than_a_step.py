# An FSDP2 script that never imports stalwart and has no __main__ guard, checkpointing
# with plain DCP. Attempt 0 trains, saves at step 2 and rank 1 SIGKILLs itself. Attempt 1
# restores with dcp.load, and the restore is long: DCP's get_state_dict first runs an
# optimizer step with zero gradients to create AdamW's state (torch's own
# `_init_optim_state`), then each rank replays its data position for RJ_REPLAY_<rank>
# seconds of CPU after the load began (rank 0 sooner, so it then waits in the next step's
# collectives on rank 1, which still replays). Then two more steps. rank 0 writes
# r.jsonl lines: start (per attempt), restored, step.
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

work = os.environ["RJ_WORK"]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
rank = dist.get_rank()
replay = float(os.environ.get(f"RJ_REPLAY_{rank}", "0"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
for layer in model:
    fully_shard(layer)
fully_shard(model)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)


def note(**rec):
    if rank == 0:
        with open(os.path.join(work, "r.jsonl"), "a") as f:
            f.write(json.dumps({**rec, "attempt": attempt, "time": time.time()}) + "\n")


class App:
    def state_dict(self):
        m, o = get_state_dict(model, optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class Position:
    """Where the data stream was; restoring it replays the stream up to there."""

    def __init__(self):
        self.step = 0
        self.began = 0.0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])
        x = 0
        while time.monotonic() < self.began + replay:
            x += 1


position = Position()
state = {"app": App(), "position": position}
note(kind="start")
step = 0
if attempt:
    position.began = time.monotonic()
    dcp.load(state, checkpoint_id=os.path.join(work, "ckpt"))
    step = position.step
    note(kind="restored", step=step)
while step < 4:
    step += 1
    model(torch.randn(4, 16)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    position.step = step
    note(kind="step", step=step)
    if attempt == 0 and step == 2:
        dcp.save(state, checkpoint_id=os.path.join(work, "ckpt"))
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
