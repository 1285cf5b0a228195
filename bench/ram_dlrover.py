"""DLRover 0.6.1 flash checkpoint on bench_ram.py's state and model (run by its venv).

``python ram_dlrover.py restore MIB REPEATS`` / ``python ram_dlrover.py stall MIB BLOCKS
PER_BLOCK``; prints one JSON line. Not launched by ``dlrover-run``: its engine then
starts the saver in a child process of local rank 0 (what its docs describe for that
case), which holds the shared memory as the agent would.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time

import torch
from ram_common import make_model, make_state, state_mib, timed_blocks


def _checkpointer(folder: str) -> object:
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    return DdpCheckpointer(folder)


def restore(mib: int, repeats: int, folder: str) -> dict[str, object]:
    from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType

    state = make_state(mib)
    ck = _checkpointer(folder)
    ck.save_checkpoint(1, state, storage_type=StorageType.MEMORY)  # type: ignore[attr-defined]
    into = {k: torch.empty_like(v).fill_(-1.0) for k, v in state.items()}
    views: list[float] = []
    copied: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loaded = ck.load_checkpoint()  # type: ignore[attr-defined]
        views.append(time.perf_counter() - t0)
        del loaded
        t0 = time.perf_counter()
        loaded = ck.load_checkpoint()  # type: ignore[attr-defined]
        with torch.no_grad():
            for k, t in into.items():
                t.copy_(loaded[k])  # what load_state_dict does with it
        copied.append(time.perf_counter() - t0)
        assert torch.equal(into["t3"], state["t3"])
        del loaded
    return {"views": views, "copied": copied}


def stall(mib: int, blocks: int, per_block: int, folder: str) -> dict[str, object]:
    from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType

    model, opt, step = make_model(mib)
    ck = _checkpointer(folder)

    def save(n: int) -> None:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        ck.save_checkpoint(n, state, storage_type=StorageType.MEMORY)  # type: ignore[attr-defined]

    for n in range(3):  # warm: the first saves create and fault in its shared memory
        save(n + 1000)
    plain, saving, inside = timed_blocks(step, save, blocks, per_block)
    return {
        "state_mib": state_mib(model, opt),
        "plain": plain,
        "saving": saving,
        "inside": inside,
        "median_inside": statistics.median(inside),
    }


def main() -> None:
    logging.disable(logging.INFO)  # its engine logs every save at INFO
    mode, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    with tempfile.TemporaryDirectory(prefix="dlrover-bench-") as folder:
        out = restore(*args, folder) if mode == "restore" else stall(*args, folder)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
