"""A plain FSDP2 + DCP training script for the resize test and benchmark.

It never imports stalwart and has no ``__main__`` guard: what a user writes after
pytorch/examples' FSDP2 example, made to run on CPU/gloo.  It trains a tiny
``fully_shard`` model, saves a DCP checkpoint of model, optimizer and data position
to ``CKPT/step_<N>`` after every step, and on start loads the newest complete step
there, whatever world size wrote it (DCP reshards at load).

The data position is a ``Stateful`` object (``state_dict``/``load_state_dict``) in the
DCP state dict, so it is saved with the step and restored with it: the batch after a
resume is the one after the loaded step.

What the tests and the benchmark read back (rank 0 writes them):

* ``OUT/full_<N>.pt``: the gathered full state (model, optimizer, data position) of
  step N, written before step N's checkpoint (so a step on disk always has one);
* ``OUT/restored_<world>_<N>.pt``: the gathered full state right after a start at
  world size ``world`` loaded step N;
* ``OUT/resumes.jsonl``: one line per start: world size, the step loaded (null: none),
  the data position loaded, wall time;
* ``OUT/steps.jsonl``: one line per step: world size, step, the batch index trained
  on, wall time.

The job ends once ``OUT/stop`` exists (every rank stops at the same step) or after
``MAX_STEPS`` steps.

    fsdp_resize_job.py OUT CKPT MAX_STEPS [STEP_S]
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import App, complete_steps, shard
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

GLOBAL_BATCH = 8
out, ckpt, max_steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
step_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class Batches:
    """The data loader's position: which global batch comes next.  A ``Stateful``: DCP
    calls ``state_dict`` at save and ``load_state_dict`` at load.  (torchdata's
    ``StatefulDataLoader`` has the same two methods and goes in the same place.)"""

    def __init__(self) -> None:
        self.next_index = 0

    def next(self) -> tuple[int, torch.Tensor]:
        index = self.next_index
        self.next_index += 1
        g = torch.Generator().manual_seed(7919 + index)
        return index, torch.randn(GLOBAL_BATCH, 24, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.next_index = int(sd["next_index"])


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = shard(
        torch.nn.Sequential(
            torch.nn.Linear(24, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 32),
            torch.nn.Linear(32, 8),
        )
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer, data: Batches) -> dict:
    """Every rank takes part (it gathers); rank 0 gets the whole state."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optim, options=opts),
        "data": data.state_dict(),
    }


def write(name: str, obj: object) -> None:
    tmp = out / f".{name}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, out / name)


def log(name: str, **row: object) -> None:
    with open(out / name, "a") as f:
        f.write(json.dumps({**row, "t": time.time()}) + "\n")


model, optim = build()
data = Batches()
loaded = None
for step in complete_steps(ckpt):
    try:
        dcp.load({"app": App(model, optim), "data": data}, checkpoint_id=ckpt / f"step_{step}")
        loaded = step
        break
    except dcp.CheckpointException as err:
        # A load that failed part way leaves some tensors overwritten: start again from
        # fresh objects before trying the step before it.
        if rank == 0:
            print(f"step {step} does not load ({err!r:.200}); trying an older one", flush=True)
        model, optim = build()
        data = Batches()

if loaded is not None:
    restored = full_state(model, optim, data)
    if rank == 0:
        write(f"restored_{world}_{loaded}.pt", restored)
if rank == 0:
    log("resumes.jsonl", world=world, loaded=loaded, next_index=data.next_index)

step = loaded or 0
while step < max_steps:
    step += 1
    index, x = data.next()
    per = GLOBAL_BATCH // world
    loss = model(x[rank * per : (rank + 1) * per]).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    state = full_state(model, optim, data)
    if rank == 0:
        write(f"full_{step}.pt", state)
    dcp.save({"app": App(model, optim), "data": data}, checkpoint_id=ckpt / f"step_{step}")
    if rank == 0:
        log("steps.jsonl", world=world, step=step, index=index)
    stop = torch.tensor([int(rank == 0 and (out / "stop").exists())])
    dist.all_reduce(stop)
    if stop.item():
        break
    time.sleep(step_s)

dist.barrier()
dist.destroy_process_group()
