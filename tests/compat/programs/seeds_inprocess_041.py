# Rank program for tests/compat/test_seeds_inprocess_041.py: hooks in NVIDIA inprocess
# 0.4's one-argument shapes (finalize(state), health_check(state), rank_assignment(ctx)).
# Deliberately without a __main__ guard: the wrapper must not run this body twice.
import json
import logging
import os

import torch.distributed as dist

import stalwart.inprocess as inprocess

logging.basicConfig(level=logging.INFO)


def emit(kind, **fields):
    fields.update(kind=kind, initial_rank=int(os.environ["RANK"]))
    os.write(1, ("EVENT " + json.dumps(fields) + "\n").encode())


class Finalize(inprocess.finalize.Finalize):
    def __call__(self, state):
        emit("finalize", iteration=state.iteration)


class HealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state):
        emit("health_check", iteration=state.iteration)
        return state


class Assignment(inprocess.rank_assignment.RankAssignment):
    def __call__(self, ctx):
        out = inprocess.rank_assignment.ShiftRanks()(ctx)
        emit(
            "assignment",
            ctx=type(ctx).__name__,
            rank=out.state.rank,
            world_size=out.state.world_size,
            left=sorted(out.terminated_ranks),
        )
        return out


@inprocess.Wrapper(
    monitor_thread_interval=0.1,
    monitor_process_interval=0.1,
    progress_watchdog_interval=0.1,
    soft_timeout=30.0,
    hard_timeout=40.0,
    heartbeat_timeout=5.0,
    barrier_timeout=60.0,
    completion_timeout=60.0,
    termination_grace_time=1.0,
    initialize=inprocess.initialize.RetryController(max_iterations=3),
    finalize=Finalize(),
    health_check=HealthCheck(),
    rank_assignment=Assignment(),
)
def fn(call: inprocess.Call) -> int:
    emit("enter", iteration=call.iteration)
    dist.init_process_group("gloo")
    dist.barrier()
    if call.iteration == 0 and call.initial_rank == 1:
        raise RuntimeError("injected")
    return call.iteration


emit("result", value=fn())
