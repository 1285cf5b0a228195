# One rank of the repeated-fault renumbering test (tests/compat/test_seeds_rank_assignment.py).
# Deliberately without a __main__ guard: the wrapper must not run this body twice.
# LEAVERS="2,1": in iteration 0 initial rank 2 leaves, in iteration 1 initial rank 1.
import json
import os
import time

from stalwart.inprocess import Call, FillGaps, Wrapper

LEAVERS = [int(r) for r in os.environ["LEAVERS"].split(",")]
EXTRA = json.loads(os.environ.get("WRAPPER_OPTIONS", "{}"))


def emit(kind, **fields):
    fields.update(kind=kind, initial_rank=int(os.environ["RANK"]))
    os.write(1, ("EVENT " + json.dumps(fields) + "\n").encode())


@Wrapper(
    rank_assignment=FillGaps(),
    monitor_thread_interval=0.1,
    monitor_process_interval=0.1,
    progress_watchdog_interval=0.1,
    soft_timeout=40.0,
    hard_timeout=45.0,
    heartbeat_timeout=5.0,
    barrier_timeout=60.0,
    completion_timeout=60.0,
    termination_grace_time=1.0,
    **EXTRA,
)
def fn(call: Call) -> int:
    emit(
        "enter",
        iteration=call.iteration,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    if call.iteration < len(LEAVERS):
        if call.initial_rank == LEAVERS[call.iteration]:
            raise SystemExit(5)
        # Wait for the leaver's fault to restart this rank (the monitor thread raises here).
        deadline = time.monotonic() + 50
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("no restart came")
    return call.rank


emit("result", value=fn())
