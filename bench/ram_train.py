"""``elastic_train.py``'s job, checkpointed through ``AsyncCheckpointer`` with RAM snapshots.

Every rank snapshots model + optimizer after every K-th step (into the launcher's memory
under ``--ckpt-ram``); every ``--persist-every``-th snapshot also goes to disk. A restarted
rank resumes from the step all ranks agree on (``AsyncCheckpointer.restore``) and records
where it came from (RAM or disk) and the newest complete step on disk at that moment, so
a test can tell a resume from a peer's replica from one from disk.

    ram_train.py STEPS OUT_DIR [--step-s S] [--save-every K] [--persist-every N] [--state-mb M]

``--save-every K`` snapshots after every K-th step (steps K-1, 2K-1, ...).

``--state-mb`` adds M MiB of per-rank data to every checkpoint (checked on restore), for
the benchmark; each attempt's first completed step is stamped in ``first_steps.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from elastic_train import model_and_opt, parser, record_attempt, save_final, train_step

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig, complete_steps


def blob(rank: int, mib: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(mib << 18, generator=g)  # 4-byte floats


def train(
    steps: int,
    out: Path,
    step_s: float,
    save_every: int,
    persist_every: int,
    state_mb: int,
    later_step_s: float | None = None,
) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    t_start = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt > 0 and later_step_s is not None:
        step_s = later_step_s
    model, opt = model_and_opt()
    ckpt = out / "ckpt"
    cfg = CheckpointerConfig(persist_every=persist_every, auto_reserve=False)
    extra = {"blob": blob(rank, state_mb)} if state_mb else {}
    with AsyncCheckpointer(ckpt, keep_last=None, config=cfg) as ck:
        disk = complete_steps(ckpt, world)
        t_restore = time.time()
        found = ck.restore()
        start, source = 0, None
        if found is not None:
            model.load_state_dict(found.state_dict["model"])
            opt.load_state_dict(found.state_dict["opt"])
            if state_mb:
                assert torch.equal(found.state_dict["blob"], extra["blob"]), "blob differs"
            start, source = found.step + 1, found.source
        ddp = DistributedDataParallel(model)
        record_attempt(
            out,
            attempt,
            rank,
            world,
            start,
            source=source,
            newest_disk=max(disk, default=None),
            process_start=t_start,
            restore_s=time.time() - t_restore,
            restored_at=time.time(),
            pid=os.getpid(),  # for a test that kills this rank's process
        )
        for step in range(start, steps):
            train_step(ddp, opt, step, rank, world)
            if (step + 1) % save_every == 0:
                ck.save({"model": model.state_dict(), "opt": opt.state_dict(), **extra}, step)
            if step == start:
                with open(out / "first_steps.jsonl", "a") as fh:
                    row = {"attempt": attempt, "rank": rank, "step": step, "t": time.time()}
                    fh.write(json.dumps(row) + "\n")
            if rank == 0:
                (out / "progress").write_text(f"{attempt} {step}")
            time.sleep(step_s)  # paces the job so a test can act on it mid-run
        ck.wait()
    save_final(model, out, rank)
    del ddp  # before the group goes: torch 2.13 can deadlock freeing it after
    dist.destroy_process_group()


def main() -> None:
    p = parser()
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--persist-every", type=int, default=10)
    p.add_argument("--state-mb", type=int, default=0)
    a = p.parse_args()
    train(a.steps, a.out, a.step_s, a.save_every, a.persist_every, a.state_mb, a.later_step_s)


if __name__ == "__main__":
    main()
