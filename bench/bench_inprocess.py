"""Fault -> first resumed training step: stalwart in-process restart vs the alternatives.

    .venv/bin/python bench/bench_inprocess.py [--repeats 5] [--only stalwart,torchrun,nvidia]

Every run is a 2-rank DDP job (4-layer MLP, gloo on CPU) launched with
``torchrun --standalone --nproc-per-node 2`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
Rank 1 faults at step 10; the figure is the time from the fault to the end of the
first training step completed on every rank afterwards.

* ``stalwart``: ``stalwart.inprocess.Wrapper`` (gloo timeout 30 s).
* ``torchrun``: no wrapper, ``--max-restarts 1``: the agent relaunches both ranks.
* ``nvidia``: ``nvidia_resiliency_ext.inprocess.Wrapper`` when installed.  Its
  survivor stays blocked in gloo until gloo's timeout, so it runs with a 3 s gloo
  timeout (with 10 s the survivor is hard-killed and the job dies).

Two faults: ``exception`` (rank 1 raises) and ``hang`` (rank 1 sleeps; soft
timeout 1 s).  torchrun has no hang detection, so it sits out the hang rows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
FAULT_STEP = 10
STEPS = 30
SOFT_TIMEOUT = 1.0
HARD_TIMEOUT = 4.0


# --------------------------------------------------------------------------- worker side
def _emit(event: str, **fields: Any) -> None:
    fields.update(ev=event, t=time.time(), rank=int(os.environ["RANK"]))
    # One write per line: both ranks share the pipe, and writes under PIPE_BUF don't interleave.
    os.write(1, ("BENCH " + json.dumps(fields) + "\n").encode())


def _worker(variant: str, fault: str) -> None:
    import logging

    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "WARNING"), format="%(asctime)s %(name)s: %(message)s"
    )
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = {"step": 0}
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def loop(iteration: int, ping: Any) -> None:
        ddp = DDP(model)
        step = torch.tensor([progress["step"]])
        dist.broadcast(step, 0)
        progress["step"] = int(step.item())
        while progress["step"] < STEPS:
            ping()
            first_attempt = iteration == 0 and restart_count == 0
            if first_attempt and progress["step"] == FAULT_STEP and dist.get_rank() == 1:
                _emit("fault")
                if fault == "exception":
                    raise RuntimeError("injected")
                time.sleep(3600)
            x = torch.randn(64, 256)
            loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            progress["step"] += 1
            _emit(
                "step",
                it=iteration + restart_count,
                step=progress["step"],
                world=dist.get_world_size(),
            )
        dist.barrier()
        dist.destroy_process_group()

    if variant == "torchrun":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        loop(0, lambda: None)
    elif variant == "stalwart":
        from stalwart.inprocess import Call, Wrapper

        @Wrapper(
            soft_timeout=SOFT_TIMEOUT,
            hard_timeout=HARD_TIMEOUT,
            heartbeat_timeout=2.0,
            monitor_thread_interval=0.1,
            monitor_process_interval=0.1,
            progress_watchdog_interval=0.1,
            termination_grace_time=1.0,
        )
        def run(call: Call) -> None:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
            loop(call.iteration, call.ping)

        run()
    elif variant == "nvidia":
        from nvidia_resiliency_ext import inprocess

        td = datetime.timedelta
        port = int(os.environ["MASTER_PORT"])
        base_store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            port + 2,
            int(os.environ["WORLD_SIZE"]),
            is_master=int(os.environ["RANK"]) == 0,
            multi_tenant=True,
            wait_for_workers=False,
        )

        def body(call_wrapper: Any = None) -> None:
            assert call_wrapper is not None
            store = dist.PrefixStore(str(call_wrapper.iteration), base_store)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=datetime.timedelta(seconds=3),
            )
            loop(call_wrapper.iteration, call_wrapper.ping)

        # Its injection matches the evaluated annotation; postponed annotations are strings.
        body.__annotations__["call_wrapper"] = typing.Optional[inprocess.CallWrapper]  # noqa: UP045
        run = inprocess.Wrapper(
            store_kwargs={"port": port + 1},
            soft_timeout=td(seconds=SOFT_TIMEOUT),
            hard_timeout=td(seconds=HARD_TIMEOUT),
            heartbeat_timeout=td(seconds=2),
            monitor_thread_interval=td(seconds=0.1),
            monitor_process_interval=td(seconds=0.1),
            progress_watchdog_interval=td(seconds=0.1),
            heartbeat_interval=td(seconds=0.1),
            last_call_wait=td(seconds=0.1),
            termination_grace_time=td(seconds=1),
        )(body)

        run()


# --------------------------------------------------------------------------- driver side
def _kill_tagged(tag: str) -> None:
    needle = f"STALWART_BENCH_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)


def _run_once(variant: str, fault: str, timeout: float) -> tuple[float | None, bool]:
    """Seconds from the fault to the first resumed step, and whether the job shrank."""
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1" if variant == "torchrun" else "0",
        "--monitor-interval",
        "0.1",
        __file__,
        "--worker",
        variant,
        "--fault",
        fault,
    ]
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    env["STALWART_BENCH_TAG"] = tag
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _kill_tagged(tag)  # an orphaned worker would hold the pipe open
        out, _ = proc.communicate()
    # torchrun puts each worker in its own session, and a worker (or a monitor
    # process) can outlive a killed agent: end every process this run started,
    # found by the tag in its environment, so none of them loads the next run.
    _kill_tagged(tag)
    events = []
    for line in out.splitlines():
        if line.startswith("BENCH "):
            try:
                events.append(json.loads(line[6:]))
            except json.JSONDecodeError:
                continue
    faults = [e["t"] for e in events if e["ev"] == "fault"]
    if not faults:
        return None, False
    fault_t = faults[0]
    firsts = []
    for rank in (0, 1):
        after = [e["t"] for e in events if e["ev"] == "step" and e["rank"] == rank and e["it"] > 0]
        if after:
            firsts.append(min(after))
    if not firsts:
        return None, False
    resumed = [e for e in events if e["ev"] == "step" and e["it"] > 0]
    shrank = any(e.get("world", 2) < 2 for e in resumed)
    # Once one rank has lost its peer for good (job shrank), its step counts alone.
    return max(firsts) - fault_t, shrank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default="stalwart,torchrun,nvidia")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fault", default="exception", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.worker, args.fault)
        return

    from rich.console import Console
    from rich.table import Table

    variants = args.only.split(",")
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except ImportError:
        variants = [v for v in variants if v != "nvidia"]
    console = Console(width=110)
    results: dict[tuple[str, str], list[float | None]] = {}
    shrunk: dict[tuple[str, str], int] = {}
    plan = [(v, "exception") for v in variants] + [(v, "hang") for v in variants if v != "torchrun"]
    for repeat in range(args.repeats):
        for variant, fault in plan:  # interleaved, so load drifts hit every column alike
            value, shrank = _run_once(variant, fault, timeout=60.0)
            results.setdefault((variant, fault), []).append(value)
            shrunk[(variant, fault)] = shrunk.get((variant, fault), 0) + int(shrank)
            shown = f"{value:.3f}s" if value is not None else "failed (job died)"
            shown += " (went on with 1 rank)" if shrank else ""
            console.print(f"[{repeat + 1}/{args.repeats}] {variant:9s} {fault:9s} {shown}")

    labels = {
        "stalwart": "stalwart in-process",
        "torchrun": "torchrun full restart",
        "nvidia": "NVIDIA in-process (gloo timeout 3 s)",
    }
    for fault, title in (
        ("exception", "exception -> first resumed step"),
        ("hang", f"hang -> first resumed step (soft timeout {SOFT_TIMEOUT:g} s)"),
    ):
        table = Table(title=f"{title}, seconds (median of {args.repeats})")
        for col in ("variant", "resumed", "shrank", "min", "median", "max", "stalwart / this"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        base = [v for v in results.get(("stalwart", fault), []) if v is not None]
        base_median = statistics.median(base) if base else None
        for variant in variants:
            if (variant, fault) not in results:
                continue
            values = results[(variant, fault)]
            ok = [v for v in values if v is not None]
            if not ok:
                table.add_row(labels[variant], f"0/{len(values)}", "-", "-", "-", "-", "-")
                continue
            med = statistics.median(ok)
            ratio = f"{base_median / med:.3f}x" if base_median is not None else "-"
            table.add_row(
                labels[variant],
                f"{len(ok)}/{len(values)}",
                str(shrunk.get((variant, fault), 0)),
                f"{min(ok):.3f}",
                f"{med:.3f}",
                f"{max(ok):.3f}",
                ratio,
            )
        console.print(table)


if __name__ == "__main__":
    main()
