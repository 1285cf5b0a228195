"""A job whose state survives a fault in memory: in-process restart + RAM restore in place.

    ram_inprocess.py OUT_DIR MIB CRASH_STEP STEPS [--inside]

Each rank holds MIB MiB of state (a tensor it keeps across restarts) and snapshots it
after every step into the launcher's memory (``stalwart run --ckpt-ram``). After
CRASH_STEP's snapshot is committed on every rank, rank 1 raises in the first iteration; ``stalwart.inprocess.Wrapper``
restarts both ranks in process, and the wrapped function restores the newest snapshot
every rank can verify in place into its existing tensor (``restore(into=...)``) and
goes on. ``--inside`` creates the ``AsyncCheckpointer`` inside the wrapped function
on every iteration instead of once outside it.

Writes ``OUT_DIR/run_<rank>.json``: per iteration the step it resumed from, where the
state came from, and wall-clock stamps (fault raised, iteration began, process group
set up, restore done, first step done), for the benchmark and the test.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig
from stalwart.inprocess import Call, Wrapper


def main() -> None:
    out, mib, crash_step, steps = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    inside = "--inside" in sys.argv[5:]
    cfg = CheckpointerConfig(persist_every=1_000_000, auto_reserve=False)
    state = {"w": torch.zeros(mib << 18)}  # 4-byte floats; survives restarts in memory
    log: list[dict[str, object]] = []
    shared: dict[str, AsyncCheckpointer] = {}
    if not inside:
        shared["ck"] = AsyncCheckpointer(out / "ckpt", keep_last=None, config=cfg)

    @Wrapper(soft_timeout=60, hard_timeout=90, heartbeat_timeout=30, barrier_timeout=120)
    def train(call: Call) -> None:
        began = time.time()
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        grouped = time.time()
        rank = dist.get_rank()
        ck = (
            shared["ck"]
            if not inside
            else AsyncCheckpointer(out / "ckpt", keep_last=None, config=cfg)
        )
        try:
            found = ck.restore(into=state)
            restored = time.time()
            start = 0 if found is None else found.step + 1
            row: dict[str, object] = {
                "iteration": call.iteration,
                "start": start,
                "source": None if found is None else found.source,
                "began": began,
                "grouped": grouped,
                "restored": restored,
                "value": float(state["w"][0]),
                "ptr": state["w"].data_ptr(),  # the same tensor on every iteration: in place
            }
            log.append(row)
            for step in range(start, steps):
                call.ping()
                state["w"].fill_(float(step + 1))  # the state after step `step`
                dist.barrier()
                if step == start:
                    row["first_step"] = time.time()
                ck.save(state, step).result(timeout=60)
                if call.iteration == 0 and step == crash_step:
                    # every rank's snapshot of this step is committed, none in flight: the
                    # fault lands in the compute between two saves, not in a copy
                    dist.barrier()
                if call.iteration == 0 and rank == 1 and step == crash_step:
                    row["fault"] = time.time()
                    raise RuntimeError(f"injected fault at step {step}")
            ck.wait()
        finally:
            if inside:
                ck.close()
        dist.destroy_process_group()

    try:
        train()
    finally:
        if "ck" in shared:
            shared["ck"].close()
        rank = int(__import__("os").environ["RANK"])
        (out / f"run_{rank}.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
