"""DDP training on gloo that restarts in-process after a fault, without relaunching.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 .venv/bin/torchrun --nproc-per-node 2 \
        examples/inprocess_train.py --steps 60 --inject exception --inject-step 20

(or ``stalwart run --nproc-per-node 2 examples/inprocess_train.py ...``).

The model and optimizer live outside the wrapped function, so they survive a
restart in memory; on re-entry DDP's constructor broadcasts rank 0's weights and
the step counter is broadcast too, so all ranks resume from the same state.
``--inject`` picks the fault (in the first iteration only): ``exception`` on one
rank, ``hang`` (soft timeout), ``gil-hang`` (hard timeout: the monitor process
kills the rank) or ``kill`` (SIGKILL; heartbeat detection).  The survivors then
go on with fewer ranks, but only under a launcher that lets a worker exit
without stopping the others: plain torchrun stops the whole job (tests/inprocess
runs those two cases with its own launcher).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.inprocess import Call, Wrapper


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=128)
    p.add_argument(
        "--inject", choices=["none", "exception", "hang", "gil-hang", "kill"], default="exception"
    )
    p.add_argument("--inject-step", type=int, default=20)
    p.add_argument("--inject-rank", type=int, default=1)
    return p.parse_args()


def inject(kind: str, call: Call) -> None:
    print(f"[rank {call.rank}] injecting {kind} at {time.time():.3f}", flush=True)
    if kind == "exception":
        raise RuntimeError("injected fault")
    if kind == "hang":
        time.sleep(3600)  # the soft timeout restarts the job
    if kind == "gil-hang":
        ctypes.PyDLL(None).sleep(3600)  # holds the GIL: only the monitor process can end it
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    args = parse_args()
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s"
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(args.width, args.width),
        nn.ReLU(),
        nn.Linear(args.width, args.width),
        nn.ReLU(),
        nn.Linear(args.width, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = {"step": 0}

    @Wrapper(
        soft_timeout=2.0,
        hard_timeout=4.0,
        heartbeat_timeout=2.0,
        monitor_thread_interval=0.2,
        monitor_process_interval=0.2,
        progress_watchdog_interval=0.2,
        termination_grace_time=1.0,
        max_iterations=5,
    )
    def train(call: Call) -> float:
        dist.init_process_group("gloo")  # env:// — the wrapper exports a fresh store per iteration
        ddp = DDP(model)  # broadcasts rank 0's weights: every rank restarts from the same model
        step = torch.tensor([progress["step"]])
        dist.broadcast(step, 0)
        progress["step"] = int(step.item())
        if call.iteration:
            print(
                f"[rank {call.rank}/{call.world_size}] resumed at step {progress['step']} "
                f"(iteration {call.iteration}) at {time.time():.3f}",
                flush=True,
            )
        loss = torch.zeros(())
        while progress["step"] < args.steps:
            call.ping()
            gen = torch.Generator().manual_seed(progress["step"] * 1000 + call.rank)
            x = torch.randn(32, args.width, generator=gen)
            y = x.sum(dim=1, keepdim=True)
            if (
                call.iteration == 0
                and call.rank == args.inject_rank
                and progress["step"] == args.inject_step
                and args.inject != "none"
            ):
                inject(args.inject, call)
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            with call.atomic():  # a restart never lands between the update and the count
                opt.step()
                progress["step"] += 1
        dist.destroy_process_group()
        return float(loss.detach())

    final = train()
    if final is not None:
        print(
            f"[rank {os.environ['RANK']}] finished {progress['step']} steps, loss {final:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
