"""A training program written for NVIDIA's ``nvidia_resiliency_ext.inprocess``, as its
documentation and examples write one: hooks subclassing its base classes with its
two-argument ``finalize``/``health_check``, a rank assignment returning a tuple,
hooks chained with ``Compose``, an annotated ``CallWrapper`` parameter, a
``PrefixStore`` per restart iteration over a store made once, and its exception
names.  Only the import line differs from the original.

Usage: ``python nvidia_inprocess_program.py SCENARIO`` with torchrun's env vars.
Prints one ``EVENT {json}`` line per observation.
"""

# Spelled as NVIDIA's examples spell it (``Optional[inprocess.CallWrapper]``).
# ruff: noqa: UP045

import datetime
import json
import os
import sys
import time
from typing import Optional

import torch

import stalwart.inprocess as inprocess  # was: import nvidia_resiliency_ext.inprocess as inprocess

INITIAL_RANK = int(os.environ["RANK"])


def emit(kind, **fields):
    fields.update(kind=kind, t=time.time(), initial_rank=INITIAL_RANK)
    os.write(1, ("EVENT " + json.dumps(fields) + "\n").encode())


def exc_name(exc):
    return None if exc is None else type(exc).__name__


class LogInitialize(inprocess.initialize.Initialize):
    def __call__(self, state):
        emit("initialize", iteration=state.iteration, rank=state.rank)
        return state


class LogAbort(inprocess.abort.Abort):
    def __call__(self, state):
        emit("abort", iteration=state.iteration)
        return state


class LogFinalize(inprocess.finalize.Finalize):
    def __call__(self, state, train_ex=None):
        emit("finalize", iteration=state.iteration, exc=exc_name(train_ex))


class LogHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state, train_ex=None):
        emit("health_check", iteration=state.iteration, exc=exc_name(train_ex))
        if train_ex is not None and INITIAL_RANK == 1 and state.iteration == 1:
            raise RuntimeError("device unhealthy after a second fault")
        return state, train_ex


class LogRankAssignment(inprocess.rank_assignment.RankAssignment):
    def __call__(self, state, terminated_ranks):
        emit(
            "rank_assignment",
            iteration=state.iteration,
            rank=state.rank,
            world_size=state.world_size,
            terminated=sorted(terminated_ranks),
        )
        return state, terminated_ranks


def make_base_store():
    # The application's own store, made once and reused by every restart iteration.
    return torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 2,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )


def train(base_store, faults, steps, call_wrapper: Optional[inprocess.CallWrapper] = None):
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    emit("enter", iteration=call_wrapper.iteration, rank=rank, world_size=world_size)
    store = torch.distributed.PrefixStore(str(call_wrapper.iteration), base_store)
    torch.distributed.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    t = torch.ones(4)
    for step in range(steps):
        call_wrapper.ping()
        if (INITIAL_RANK, call_wrapper.iteration, step) in faults:
            emit("fault", iteration=call_wrapper.iteration)
            raise RuntimeError(f"example fault at {step=} from {rank=}")
        torch.distributed.all_reduce(t)
        with call_wrapper.atomic():
            pass
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    emit("done", iteration=call_wrapper.iteration, world_size=world_size)
    return call_wrapper.iteration


def wrapper_kwargs(**extra):
    kwargs = dict(
        store_kwargs={"port": int(os.getenv("MASTER_PORT", 29500)) + 1},
        monitor_thread_interval=datetime.timedelta(seconds=0.1),
        monitor_process_interval=datetime.timedelta(seconds=0.1),
        progress_watchdog_interval=datetime.timedelta(seconds=0.1),
        soft_timeout=datetime.timedelta(seconds=20),
        hard_timeout=datetime.timedelta(seconds=25),
        heartbeat_timeout=datetime.timedelta(seconds=3),
        barrier_timeout=datetime.timedelta(seconds=30),
        completion_timeout=datetime.timedelta(seconds=30),
    )
    kwargs.update(extra)
    return kwargs


def scenario_hooks():
    """Rank 1 faults in iterations 0 and 1 and is unhealthy after the second."""
    wrapped = inprocess.Wrapper(
        **wrapper_kwargs(
            initialize=LogInitialize(),
            abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), LogAbort()),
            finalize=LogFinalize(),
            health_check=inprocess.Compose(
                inprocess.health_check.FaultCounter(max_rank_faults=5),
                LogHealthCheck(),
            ),
            rank_assignment=inprocess.Compose(
                inprocess.rank_assignment.ShiftRanks(), LogRankAssignment()
            ),
        )
    )(train)
    base_store = make_base_store()
    try:
        emit("result", value=wrapped(base_store, {(1, 0, 3), (1, 1, 2)}, 6))
    except inprocess.exception.RestartError as exc:
        emit(
            "error",
            type=type(exc).__name__,
            health=isinstance(exc, inprocess.exception.HealthCheckError),
        )
        sys.exit(3)


def scenario_retry():
    """Every iteration fails; RetryController stops the job after two."""

    def always_fails(call_wrapper: Optional[inprocess.CallWrapper] = None):
        emit("enter", iteration=call_wrapper.iteration)
        raise RuntimeError(f"fails in iteration {call_wrapper.iteration}")

    wrapped = inprocess.Wrapper(
        **wrapper_kwargs(initialize=inprocess.initialize.RetryController(max_iterations=2))
    )(always_fails)
    try:
        wrapped()
    except inprocess.exception.RestartAbort as exc:  # what NVIDIA's RetryController raises
        emit("error", abort=True, message=str(exc))


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"]()
