# Rank program for tests/compat/test_seeds_rank_tree.py: NVIDIA inprocess 0.4's
# Tree rank assignment with a reserve rank, three ranks, one killed in iteration 0.
# Deliberately without a __main__ guard: the wrapper must not run this body twice.
import json
import os
import signal

import torch
import torch.distributed as dist

import stalwart.inprocess as inprocess

RA = inprocess.rank_assignment


def emit(kind, **fields):
    fields.update(kind=kind, initial_rank=int(os.environ["RANK"]))
    os.write(1, ("EVENT " + json.dumps(fields) + "\n").encode())


class Assignment(RA.Tree):
    def __call__(self, ctx):
        out = super().__call__(ctx)
        emit(
            "assignment",
            rank=out.state.rank,
            world_size=out.state.world_size,
            active_rank=out.state.active_rank,
            active_world_size=out.state.active_world_size,
            mode=out.state.mode.value,
        )
        return out


@inprocess.Wrapper(
    monitor_thread_interval=0.1,
    monitor_process_interval=0.1,
    progress_watchdog_interval=0.1,
    soft_timeout=30.0,
    hard_timeout=40.0,
    heartbeat_timeout=3.0,
    barrier_timeout=60.0,
    completion_timeout=60.0,
    termination_grace_time=1.0,
    initialize=inprocess.initialize.RetryController(max_iterations=3),
    rank_assignment=Assignment(
        [RA.Layer(max_ranks=2, key_or_fn="root", flag=RA.LayerFlag.RESERVE)],
        timeout=60.0,
    ),
)
def fn(call: inprocess.Call) -> list:
    emit(
        "enter",
        iteration=call.iteration,
        rank=call.rank,
        world_size=call.world_size,
        env=[os.environ["RANK"], os.environ["WORLD_SIZE"]],
    )
    dist.init_process_group("gloo")
    dist.barrier()
    if call.iteration == 0 and call.initial_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    value = torch.tensor([float(call.initial_rank)])
    dist.all_reduce(value)
    return [call.iteration, value.item()]


emit("result", value=fn())
