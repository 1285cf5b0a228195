"""A real DDP training job on gloo that survives faults: stalwart's main example.

    stalwart run --nproc-per-node 2 --max-restarts 3 --log-dir runs/ \
        examples/train_ddp.py --steps 200 --inject ...

A 4-layer MLP learns a fixed random linear map from synthetic data.  Each step's batch
is a pure function of (seed, step, rank), and rank 0 saves model + optimizer state
asynchronously every ``--ckpt-every`` steps, so after any restart the job resumes from
the newest checkpoint that verifies and ends with exactly the weights an uninterrupted
run would have (``--out`` writes their checksum).  It runs under ``torchrun`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart import inject, timer
from stalwart.checkpoint import AsyncCheckpointer, load_latest
from stalwart.monitor import RankMonitorClient


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="default: runs/ckpt/<run id>")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--slow-every", type=int, default=0, help="every N-th step is slow (0: none)")
    p.add_argument("--slow-step", type=float, default=0.25, help="extra seconds of a slow step")
    p.add_argument(
        "--progress", type=Path, default=None, help="rank 0 appends one JSON line per step"
    )
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes the final result as JSON")
    p.add_argument("--quiet", action="store_true", help="print every 10th step only")
    p.add_argument(
        "--heartbeat", action="store_true", help="heartbeat to the hang monitor each step"
    )
    p.add_argument(
        "--step-timer", type=float, default=None, help="run each step under a timer of S seconds"
    )
    return p.parse_args()


def make_model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 8),
    )


def batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, 32, generator=g)
    target_map = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 8, generator=target_map)
    return x, x @ w


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as bytes, in one copy: ``bytes(storage)`` would walk the
    storage one element at a time in Python (minutes for a 145 MB model)."""
    compact = t.detach().cpu().contiguous()
    return ctypes.string_at(compact.data_ptr(), compact.nbytes)


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    ckpt_dir = args.ckpt_dir or Path("runs") / "ckpt" / run_id
    torch.set_num_threads(1)

    model = make_model(args.width, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    # The DDP state is replicated, so every rank resumes from rank 0's checkpoint.
    found = load_latest(ckpt_dir, rank=0)
    if found is not None:
        model.load_state_dict(found.state_dict["model"])
        opt.load_state_dict(found.state_dict["optim"])
        start = int(found.state_dict["step"])
        if rank == 0:
            print(f"resumed from {found.path} at step {start} (attempt {attempt})", flush=True)
    ddp = DDP(model)
    # One writer for a replicated state: the checkpoint is complete when rank 0 committed it.
    ckpt = (
        AsyncCheckpointer(ckpt_dir, keep_last=args.keep_last, rank=0, world_size=1)
        if rank == 0
        else None
    )
    progress = open(args.progress, "a") if args.progress and rank == 0 else None  # noqa: SIM115

    monitor = RankMonitorClient() if args.heartbeat else None
    if monitor is not None:
        monitor.init_workload_monitoring()
    loss_value = float("nan")
    for step in range(start, args.steps):
        guard = (
            timer.expires(after=args.step_timer, scope="step")
            if args.step_timer
            else contextlib.nullcontext()
        )
        with guard:
            inject.step(step)
            x, y = batch(args.seed, step, rank, args.batch)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            loss_value = loss.item()
        if monitor is not None:
            monitor.send_heartbeat()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.slow_every and step % args.slow_every == args.slow_every - 1:
            time.sleep(args.slow_step)  # a simulated slow step (evaluation, logging burst)
        if rank == 0 and (not args.quiet or step % 10 == 0):
            print(f"attempt {attempt} step {step} loss {loss_value:.5f}", flush=True)
        if progress is not None:
            progress.write(
                json.dumps(
                    {"attempt": attempt, "step": step, "time": time.time(), "loss": loss_value}
                )
                + "\n"
            )
            progress.flush()
        done = step + 1
        if ckpt is not None and (done % args.ckpt_every == 0 or done == args.steps):
            ckpt.save(
                {"model": model.state_dict(), "optim": opt.state_dict(), "step": done}, step=done
            )

    if monitor is not None:
        # Training is over: waiting for the last save is not a hang.
        monitor.shutdown_workload_monitoring()
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    if rank == 0:
        result = {
            "steps": args.steps,
            "loss": loss_value,
            "checksum": checksum(model),
            "world_size": world,
            "attempt": attempt,
        }
        print(f"done: {json.dumps(result)}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(result))
    # Free DDP while torch still owns the process group, so that the group dies in
    # destroy_process_group(), whose path releases the GIL. Dying in the reducer's
    # destructor, it would join gloo's threads with the GIL held, and a thread freeing a
    # finished work needs the GIL: a deadlock at exit (cf. pytorch/pytorch#56297).
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
