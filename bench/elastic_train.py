"""A gloo DDP job whose result does not depend on how many nodes ran it, or when.

Step *s* trains on a fixed global batch drawn from seed *s*, split evenly across the
ranks; DDP averages the equal-sized shards' gradients, so every world size follows the
same trajectory (up to float rounding).  Rank 0 saves the model after every step
(temp file + rename), and a restarted job resumes there.  ``--reference`` trains the
same steps in one process without torch.distributed.

    elastic_train.py STEPS OUT_DIR [--step-s S] [--later-step-s S]   (under stalwart run)
    elastic_train.py STEPS OUT_FILE --reference
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

GLOBAL_BATCH = 8


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(
    ddp: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int
) -> None:
    """Step ``step`` on this rank's shard of the step's global batch."""
    per = GLOBAL_BATCH // world
    x, y = batch(step)
    opt.zero_grad()
    sl = slice(rank * per, (rank + 1) * per)
    torch.nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
    opt.step()


def save_final(model: torch.nn.Module, out: Path, rank: int) -> None:
    """Rank 0 saves the final model; every rank waits for the others to be done."""
    import torch.distributed as dist

    if rank == 0:
        torch.save(model.state_dict(), out / "final.pt")
    dist.barrier()


def record_attempt(
    out: Path, attempt: int, rank: int, world: int, start: int, **more: object
) -> None:
    """One line of ``attempts.jsonl`` per rank and attempt: where it started from."""
    row = {"attempt": attempt, "rank": rank, "world": world, "start": start, **more}
    row["group_rank"] = int(os.environ["GROUP_RANK"])
    with open(out / "attempts.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")


def parser() -> argparse.ArgumentParser:
    """The arguments every job of this kind takes."""
    p = argparse.ArgumentParser()
    p.add_argument("steps", type=int)
    p.add_argument("out", type=Path)
    p.add_argument("--step-s", type=float, default=0.05)
    # Pacing after a restart (default: --step-s): a test that acts only on the first
    # attempt need not wait out the rest.
    p.add_argument("--later-step-s", type=float, default=None)
    return p


def reference_state(steps: int) -> dict[str, torch.Tensor]:
    """The model after ``steps`` steps in one process, without torch.distributed."""
    model, opt = model_and_opt()
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def reference(steps: int, out: Path) -> None:
    torch.save(reference_state(steps), out)


def train(steps: int, out: Path, step_s: float, later_step_s: float | None = None) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert GLOBAL_BATCH % world == 0, world
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt > 0 and later_step_s is not None:
        step_s = later_step_s
    model, opt = model_and_opt()
    ckpt = out / "ckpt.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    ddp = DistributedDataParallel(model)
    record_attempt(out, attempt, rank, world, start, host_addr=os.environ["MASTER_ADDR"])
    for step in range(start, steps):
        train_step(ddp, opt, step, rank, world)
        if rank == 0:
            tmp = out / "ckpt.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
            (out / "progress").write_text(f"{attempt} {step}")
        time.sleep(step_s)  # paces the job so a test can act on it mid-run
    save_final(model, out, rank)
    del ddp  # before the group goes: torch 2.13 can deadlock freeing it after
    dist.destroy_process_group()


def main() -> None:
    p = parser()
    p.add_argument("--reference", action="store_true")
    a = p.parse_args()
    if a.reference:
        reference(a.steps, a.out)
    else:
        train(a.steps, a.out, a.step_s, a.later_step_s)


if __name__ == "__main__":
    main()
