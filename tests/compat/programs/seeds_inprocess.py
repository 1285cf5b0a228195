# Rank program for tests/compat/test_seeds_inprocess.py; argv[1] names the scenario.
# Deliberately without a __main__ guard: the wrapper must not run this body twice.
import json
import logging
import os
import sys
import time

import torch.distributed as dist

from stalwart.inprocess import Call, Wrapper

SCENARIO = sys.argv[1]
FAST = dict(
    monitor_thread_interval=0.1,
    monitor_process_interval=0.1,
    progress_watchdog_interval=0.1,
    soft_timeout=30.0,
    hard_timeout=40.0,
    heartbeat_timeout=5.0,
    barrier_timeout=60.0,
    completion_timeout=60.0,
    termination_grace_time=1.0,
)


def emit(kind, **fields):
    fields.update(kind=kind, initial_rank=int(os.environ["RANK"]))
    os.write(1, ("EVENT " + json.dumps(fields) + "\n").encode())


class SlowToFree:
    """Its destructor is where the main thread spends most of its time."""

    def __del__(self):
        time.sleep(0.5)


def busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


if SCENARIO == "destructor":
    logging.basicConfig(level=logging.INFO)

    @Wrapper(**FAST)
    def fn(call: Call) -> int:
        emit("enter", iteration=call.iteration)
        if call.iteration > 0:
            return call.iteration
        dist.init_process_group("gloo")
        dist.barrier()
        if call.initial_rank == 1:
            time.sleep(0.5)  # rank 0 is freeing objects by now
            raise RuntimeError("injected")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            obj = SlowToFree()
            del obj
            busy(0.03)
        emit("restart_lost")
        return -1

    emit("result", value=fn())

elif SCENARIO in ("quiet", "debug"):
    if SCENARIO == "debug":
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)

    @Wrapper(**FAST, monitor_process_logfile=os.environ["MONITOR_LOG"])
    def fn(call: Call) -> int:
        return 7

    emit("result", value=fn(), pid=os.getpid())
