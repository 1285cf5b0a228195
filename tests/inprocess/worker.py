"""Worker program for the in-process restart tests: one rank, one scenario.

Prints one ``EVENT {json}`` line per observation; the tests read them back.
Usage: ``python worker.py SCENARIO`` with torchrun's env vars set.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from stalwart.inprocess import ActiveWorldSize, Call, RestartAbort, RestartError, State, Wrapper
from stalwart.inprocess.sockets import open_fd_count

INITIAL_RANK = int(os.environ["RANK"])
GLOO_TIMEOUT = datetime.timedelta(seconds=30)


def emit(kind: str, **fields: Any) -> None:
    fields.update(kind=kind, t=time.time(), initial_rank=INITIAL_RANK)
    # One write per line: under torchrun both ranks share one pipe.
    os.write(1, ("EVENT " + json.dumps(fields) + "\n").encode())


def fast(**overrides: Any) -> dict[str, Any]:
    """Timeouts small enough for tests on a loaded 2-core machine."""
    opts: dict[str, Any] = dict(
        monitor_thread_interval=0.1,
        monitor_process_interval=0.1,
        progress_watchdog_interval=0.1,
        soft_timeout=20.0,
        hard_timeout=25.0,
        heartbeat_timeout=3.0,
        barrier_timeout=30.0,
        completion_timeout=30.0,
        termination_grace_time=1.0,
    )
    opts.update(overrides)
    return opts


def train(
    call: Call,
    progress: dict[str, int],
    steps: int,
    fault: Any = None,
    call_store: bool = False,
    ping: bool = True,
) -> int:
    """A small all_reduce loop; ``progress`` survives restarts (in-memory state)."""
    emit("enter", iteration=call.iteration, rank=call.rank, world_size=call.world_size)
    if call_store:  # the explicit form: the wrapper's per-iteration store
        dist.init_process_group(
            "gloo",
            store=call.store,
            rank=call.rank,
            world_size=call.world_size,
            timeout=GLOO_TIMEOUT,
        )
    else:  # env://, through the MASTER_PORT the wrapper exports
        dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
    # A spare joining late has no progress of its own: rank 0's counter wins.
    step = torch.tensor([progress["step"]])
    dist.broadcast(step, 0)
    progress["step"] = int(step.item())
    t = torch.ones(8)
    while progress["step"] < steps:
        if ping:
            call.ping()
        if fault is not None:
            fault(call, progress["step"])
        emit("step_begin", iteration=call.iteration, step=progress["step"])
        dist.all_reduce(t)
        with call.atomic():
            progress["step"] += 1
    dist.barrier()
    dist.destroy_process_group()
    emit("done", iteration=call.iteration, step=progress["step"], world_size=call.world_size)
    return progress["step"]


def scenario_exception() -> None:
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 5 and call.rank == 1:
            time.sleep(0.5)  # rank 0 is blocked in all_reduce by now
            emit("fault")
            raise RuntimeError("injected")

    @Wrapper(**fast())
    def fn(call: Call) -> int:
        return train(call, progress, 10, fault)

    emit("result", value=fn())


def scenario_soft_hang() -> None:
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 3 and call.rank == 1:
            emit("fault")
            time.sleep(60)

    @Wrapper(**fast(soft_timeout=1.0, hard_timeout=20.0))
    def fn(call: Call) -> int:
        return train(call, progress, 6, fault)

    emit("result", value=fn())


def scenario_blocked_no_ping() -> None:
    """A function that never pings: rank 1 blocks in C with the GIL released, rank 0 in
    its all_reduce; only the main-thread tick can tell."""
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 3 and call.rank == 1:
            emit("fault")
            time.sleep(60)

    @Wrapper(**fast(soft_timeout=1.5, hard_timeout=20.0))
    def fn(call: Call) -> int:
        return train(call, progress, 6, fault, ping=False)

    emit("result", value=fn())


def scenario_gil_hang() -> None:
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 3 and call.rank == 1:
            emit("fault")
            # libc sleep through PyDLL keeps the GIL: no Python thread can run.
            ctypes.PyDLL(None).sleep(60)

    @Wrapper(
        **fast(soft_timeout=1.0, hard_timeout=2.0, termination_grace_time=0.5),
        monitor_process_logfile=os.environ.get("MONITOR_LOG"),
    )
    def fn(call: Call) -> int:
        return train(call, progress, 6, fault)

    emit("result", value=fn())


def scenario_sigkill() -> None:
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 3 and call.initial_rank == 1:
            emit("fault")
            os.kill(os.getpid(), signal.SIGKILL)

    kwargs: dict[str, Any] = fast()
    if os.environ.get("SPARES"):
        kwargs["rank_filter"] = ActiveWorldSize(int(os.environ["WORLD_SIZE"]) - 1)

    @Wrapper(**kwargs)
    def fn(call: Call) -> int:
        return train(call, progress, 6, fault)

    emit("result", value=fn())


def scenario_health() -> None:
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 2 and call.rank == 1:
            raise RuntimeError("injected")

    def health_check(state: State, exc: BaseException | None) -> None:
        if exc is not None and state.initial_rank == 1:
            raise RuntimeError("unhealthy device")

    @Wrapper(health_check=health_check, **fast())
    def fn(call: Call) -> int:
        return train(call, progress, 5, fault)

    try:
        emit("result", value=fn())
    except Exception as exc:
        emit("error", type=type(exc).__name__, message=str(exc))
        sys.exit(3)


def scenario_hooks() -> None:
    progress = {"step": 0}

    def initialize(state: State) -> State:
        emit("initialize", iteration=state.iteration)
        if state.iteration == 0 and state.initial_rank == 1:
            raise ValueError("bad init")
        return state

    def finalize(state: State, exc: BaseException | None) -> None:
        emit("finalize", iteration=state.iteration)
        if state.iteration == 1 and state.initial_rank == 0:
            raise ValueError("bad finalize")

    @Wrapper(initialize=initialize, finalize=finalize, **fast())
    def fn(call: Call) -> int:
        return train(call, progress, 3)

    try:
        emit("result", value=fn())
    except Exception as exc:
        emit(
            "error",
            type=type(exc).__name__,
            message=str(exc),
            notes=getattr(exc, "__notes__", []),
            cause=type(exc.__cause__).__name__ if exc.__cause__ else None,
        )


def scenario_base_exit() -> None:
    """Initial rank ``LEAVER`` raises the BaseException named by ``EXC`` mid-training."""
    leaver = int(os.environ["LEAVER"])
    exc_type: type[BaseException] = {
        "SystemExit": SystemExit,
        "KeyboardInterrupt": KeyboardInterrupt,
        "GeneratorExit": GeneratorExit,
        "RestartAbort": RestartAbort,  # NVIDIA's "abort the wrapper"
    }[os.environ["EXC"]]
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 3 and call.initial_rank == leaver:
            time.sleep(0.3)  # the peer is blocked in all_reduce by now
            emit("fault")
            raise exc_type(7) if exc_type is SystemExit else exc_type()

    @Wrapper(**fast())
    def fn(call: Call) -> int:
        return train(call, progress, 6, fault)

    try:
        emit("result", value=fn())
    except BaseException as exc:
        emit("left", type=type(exc).__name__)
        raise


def scenario_leaks() -> None:
    restarts = int(os.environ.get("RESTARTS", "20"))

    @Wrapper(max_iterations=restarts + 5, **fast())
    def fn(call: Call) -> int:
        gc.collect()
        emit(
            "resources",
            iteration=call.iteration,
            threads=threading.active_count(),
            fds=open_fd_count(),
        )
        dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
        t = torch.ones(4)
        dist.all_reduce(t)
        if call.iteration < restarts:
            if call.rank == call.iteration % 2:
                raise RuntimeError("injected")
            dist.all_reduce(t)  # the survivor blocks here until released
        dist.destroy_process_group()
        return call.iteration

    emit("result", value=fn())


def scenario_max_iterations() -> None:
    @Wrapper(max_iterations=2, **fast())
    def fn(call: Call) -> int:
        raise RuntimeError(f"always fails (iteration {call.iteration})")

    try:
        fn()
    except Exception as exc:
        emit(
            "error",
            restart_error=isinstance(exc, RestartError),
            restart_abort=isinstance(exc, RestartAbort),
            message=str(exc),
        )


def scenario_twice() -> None:
    """The same process runs two wrapped jobs in turn (env://, then call.store)."""
    for job in range(2):
        emit("result", value=_one_job(job), job=job, rank_env=os.environ["RANK"])


def _one_job(job: int) -> int | None:
    progress = {"step": 0}

    def fault(call: Call, step: int) -> None:
        if call.iteration == 0 and step == 2 and call.rank == job:
            raise RuntimeError("injected")

    @Wrapper(**fast())
    def fn(call: Call) -> int:
        return train(call, progress, 4, fault, call_store=job == 1)

    return fn()


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"]()
