"""A job with MIB MiB of state per rank that trains at a steady pace, snapshots it every
SAVE_EVERY steps, and faults once: crash -> first resumed step and -> back at full speed.

    ram_fullspeed.py OUT MIB STEPS SAVE_EVERY FAULT_AT FAULT SAVER [--inprocess]

FAULT: ``crash`` (rank 1 raises) or ``kill`` (rank 1 SIGKILLs itself), at step FAULT_AT
of the first attempt. SAVER: ``ram`` (``AsyncCheckpointer``, RAM only under
``stalwart run --ckpt-ram``, restored in place with ``restore(into=...)``) or ``torch``
(the anchor: ``torch.save`` of the state to a local file, written to a temporary name
and renamed; ``torch.load(weights_only=True)`` and a copy into the state on restart).
``--inprocess`` runs the loop inside ``stalwart.inprocess.Wrapper``: the state tensors
and the checkpointer survive the fault in the process.

Each step touches one eighth of the state (``add_``, as an optimizer's update would,
so all of it within 8 steps), does a fixed matmul and an all-reduce. The state's values
are known from the step count, and every restore checks them. Rank 0 appends one line
per step to ``OUT/p.jsonl`` (attempt, step, end time); rank 1 writes ``OUT/fault`` (the
time of the fault); each rank writes ``OUT/stamps_<attempt>_<rank>.json`` (process
start, state built, restored, first step done), for bench_ram.py's stages.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

T_MAIN = time.time()

from collections.abc import Callable  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TENSORS = 8


def expected(i: int, rank: int, done: int) -> float:
    """Tensor i's value once steps 0..done-1 ran: each step adds 1 to tensor step % 8."""
    return float(i + rank + sum(1 for s in range(done) if s % TENSORS == i))


class TorchSaver:
    """The anchor: what a torchrun user writes, torch.save to local disk."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / f"rank_{rank}.pt"
        folder.mkdir(parents=True, exist_ok=True)

    def save(self, state: dict[str, torch.Tensor], step: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({"step": step, "state": state}, tmp)
        os.replace(tmp, self.path)

    def restore(self, state: dict[str, torch.Tensor]) -> int | None:
        if not self.path.exists():
            return None
        found = torch.load(self.path, weights_only=True)
        for k, t in state.items():
            t.copy_(found["state"][k])
        return int(found["step"])

    def close(self) -> None:
        pass


class RamSaver:
    def __init__(self, folder: Path) -> None:
        from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig

        cfg = CheckpointerConfig(persist_every=10**9, auto_reserve=False)
        self.ck = AsyncCheckpointer(folder, keep_last=None, config=cfg)

    def save(self, state: dict[str, torch.Tensor], step: int) -> None:
        self.ck.save(state, step)

    def restore(self, state: dict[str, torch.Tensor]) -> int | None:
        found = self.ck.restore(into=state)
        return None if found is None else found.step

    def close(self) -> None:
        self.ck.close()


def main() -> None:
    out, mib, steps, save_every, fault_at = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        int(sys.argv[5]),
    )
    fault, saver_kind = sys.argv[6], sys.argv[7]
    inprocess = "--inprocess" in sys.argv[8:]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    n = (mib << 20) // 4 // TENSORS
    state = {f"t{i}": torch.full((n,), expected(i, rank, 0)) for i in range(TENSORS)}
    t_state = time.time()
    saver: TorchSaver | RamSaver = (
        RamSaver(out / "ckpt") if saver_kind == "ram" else TorchSaver(out / "ckpt", rank)
    )
    a = torch.randn(256, 256)

    def run(attempt: int, ping: Callable[[], None]) -> None:
        stamps = {"main": T_MAIN, "state": t_state, "began": time.time()}
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        step = saver.restore(state)
        start = 0 if step is None else step + 1
        stamps["restored"] = time.time()
        for i, t in state.items():
            want = expected(int(i[1:]), rank, start)
            if float(t[0]) != want or float(t[-1]) != want:
                raise SystemExit(f"rank {rank}: {i} is {float(t[0])}, expected {want}")
        progress = open(out / "p.jsonl", "a") if rank == 0 else None  # noqa: SIM115
        x = torch.ones(1)
        for s in range(start, steps):
            ping()
            state[f"t{s % TENSORS}"].add_(1.0)
            for _ in range(4):
                a.mm(a)
            dist.all_reduce(x)
            if (s + 1) % save_every == 0:
                saver.save(state, s)
            now = time.time()
            if s == start:
                stamps["step"] = now
                stamps["start"] = start
                (out / f"stamps_{attempt}_{rank}.json").write_text(json.dumps(stamps))
            if progress is not None:
                progress.write(json.dumps({"attempt": attempt, "step": s, "time": now}) + "\n")
                progress.flush()
            if attempt == 0 and rank == 1 and s == fault_at:
                (out / "fault").write_text(repr(time.time()))
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault at step {s}")
        if progress is not None:
            progress.close()
        dist.destroy_process_group()

    try:
        if inprocess:
            from stalwart.inprocess import Call, Wrapper

            @Wrapper(soft_timeout=60, hard_timeout=90, heartbeat_timeout=30, barrier_timeout=120)
            def wrapped(call: Call) -> None:
                run(call.iteration, call.ping)

            wrapped()
        else:
            run(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), lambda: None)
    finally:
        saver.close()


if __name__ == "__main__":
    main()
