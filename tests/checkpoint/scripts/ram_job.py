"""A 2-rank job for the RAM snapshot tests: save steps 1..5, crash, restore on restart.

--mode crash:   snapshots only in the launcher's memory (persist_every large); the
                restarted ranks must resume from RAM with nothing on disk.
--mode corrupt: every save on disk; rank 1 flips a byte of its newest file before the
                crash; all ranks must resume from the step before.
Each rank writes what it restored to OUT/result_rank<R>.json on the second attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig, load_latest


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["crash", "corrupt"], required=True)
    p.add_argument("--pg", action="store_true", help="agree through a gloo process group")
    a = p.parse_args()
    rank = int(os.environ["RANK"])
    out = Path(a.out)
    if a.pg:
        dist.init_process_group("gloo")
    persist = 1000 if a.mode == "crash" else 1
    with AsyncCheckpointer(a.ckpt, config=CheckpointerConfig(persist_every=persist)) as ck:
        found = ck.restore()
        second = (out / f"crashed_rank{rank}").exists()
        if second:
            ok = found is not None and torch.equal(
                found.state_dict["w"], torch.full((1000,), float(found.step + rank))
            )
            result = {
                "step": found.step if found else None,
                "source": found.source if found else None,
                "ok": bool(ok),
                "pid": os.getpid(),
            }
            (out / f"result_rank{rank}.json").write_text(json.dumps(result))
        else:
            assert found is None, found
            for step in range(1, 6):
                ck.save({"w": torch.full((1000,), float(step + rank)), "step": step}, step)
            ck.wait()
            (out / f"saved_rank{rank}").touch()
            if a.mode == "corrupt" and rank == 1:
                wait_for(out / "saved_rank0")  # step 5 is complete only once rank 0 wrote it
                newest = load_latest(a.ckpt, rank=1)
                assert newest is not None and newest.step == 5
                with open(newest.path, "r+b") as f:
                    f.seek(-200, os.SEEK_END)
                    byte = f.read(1)
                    f.seek(-200, os.SEEK_END)
                    f.write(bytes([byte[0] ^ 0xFF]))
            (out / f"crashed_rank{rank}").touch()
            wait_for(out / f"crashed_rank{1 - rank}")
    if a.pg:
        dist.destroy_process_group()
    if not second:
        sys.exit(1)  # the launcher restarts both ranks


if __name__ == "__main__":
    main()
