"""Checkpoints in launcher-owned RAM (issue 16) against reading them back from disk.

Three measurements, side by side in one run:

1. restore: one rank's share of the state (``--size-mib`` per rank) from the launcher's
   snapshot memory (``restore()``, copy out + checksums) vs ``torch.load(weights_only=True)``
   of the same state from a file whose page cache was dropped (``posix_fadvise
   DONTNEED``; the bench says when that failed), and from a warm page cache.
2. crash -> first resumed step: ``stalwart run`` with 2 ranks, each holding
   ``--size-mib``; rank 0 dies right after a save; the time from the crash to the first
   step of the restarted job, resuming from RAM (``--ckpt-ram``) vs from disk.
3. save stall at every step: a model + Adam of about ``--stall-mib`` in total trained on
   the CPU, ``save()`` after every step with ``persist_every=1000`` (RAM only), stall
   per save against the step time.

Usage: ``flock /tmp/stalwart-bench.lock .venv/bin/python bench/bench_ram.py --markdown``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import fmt, machine, med, show, spread  # noqa: E402

_JOB = r"""
import json, os, sys, time
from pathlib import Path
import torch
from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig

def main():
    out, mib, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    persist = 1 if mode == "disk" else 1000
    ck = AsyncCheckpointer(out / "ckpt", config=CheckpointerConfig(persist_every=persist))
    marker = out / f"crashed_{rank}"
    if not marker.exists():
        state = {f"t{i}": torch.full((mib << 15,), float(i + rank)) for i in range(8)}
        ck.save(state, step=10)
        ck.wait()
        if mode == "disk":
            for f in (out / "ckpt").glob(f"step_*/rank_{rank}.pt"):
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        marker.write_text(repr(time.time()))
        if rank == 0:
            os._exit(1)
        time.sleep(600)  # killed by the launcher's restart
    found = ck.restore()
    t = (found.state_dict["t0"] * 2).sum()  # the first step touches the state
    (out / f"resumed_{rank}.json").write_text(json.dumps(
        {"t": time.time(), "source": found.source, "step": found.step, "x": float(t)}))
    ck.close()

if __name__ == "__main__":
    main()
"""


def _state(mib: int, tensors: int = 8) -> dict[str, object]:
    import torch

    n = (mib << 20) // 4 // tensors
    return {f"t{i}": torch.full((n,), float(i)) for i in range(tensors)}


def bench_restore(mib: int, repeats: int, work: Path) -> list[list[str]]:
    import torch

    from stalwart.checkpoint import ramlayout as rl
    from stalwart.checkpoint.ram import RamSegment
    from stalwart.checkpoint.resume import restore
    from stalwart.checkpoint.staging import plan
    from stalwart.launch.snapshots import SnapshotMemory

    state = _state(mib)
    mem = SnapshotMemory(1, (mib << 20) + (8 << 20))
    os.environ.update(mem.worker_env())
    os.environ["LOCAL_RANK"] = "0"
    ram_s: list[float] = []
    disk_cold: list[float] = []
    disk_warm: list[float] = []
    dropped = True
    try:
        seg = RamSegment.open(mem.folder / rl.segment_name(0))
        seg.write(plan(state), 1, rank=0, world_size=1, threads=4)
        seg.close()
        for _ in range(repeats):
            t0 = time.perf_counter()
            found = restore(work / "none", rank=0, world_size=1)
            ram_s.append(time.perf_counter() - t0)
            assert found is not None and found.source == "ram"
            del found
        path = work / "state.pt"
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        for _ in range(repeats):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                dropped = False
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            disk_cold.append(time.perf_counter() - t0)
            del loaded
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            disk_warm.append(time.perf_counter() - t0)
            del loaded
        os.close(fd)
        path.unlink()
    finally:
        mem.close()
    gib = mib / 1024
    cold = "disk, page cache dropped" if dropped else "disk (page cache NOT dropped)"
    return [
        ["RAM snapshot (restore)", spread(ram_s), fmt((med(ram_s) or 0) / gib, "s/GiB")],
        [f"torch.load, {cold}", spread(disk_cold), fmt((med(disk_cold) or 0) / gib, "s/GiB")],
        [
            "torch.load, page cache warm",
            spread(disk_warm),
            fmt((med(disk_warm) or 0) / gib, "s/GiB"),
        ],
    ]


def _crash_once(mode: str, mib: int, work: Path) -> tuple[float | None, str]:
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"crash-{mode}-"))
    script = out / "job.py"
    script.write_text(_JOB)
    cmd = [sys.executable, "-m", "stalwart.cli", "run", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--log-dir", str(out / "logs")]
    if mode == "ram":
        cmd += ["--ckpt-ram", f"{mib + 8}MiB"]
    cmd += [str(script), str(out), str(mib), mode]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_"))}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    try:
        crashed = float((out / "crashed_0").read_text())
        resumed = [json.loads((out / f"resumed_{r}.json").read_text()) for r in (0, 1)]
    except (OSError, ValueError):
        return None, f"failed (exit {res.returncode}): {res.stderr[-300:]}"
    sources = {r["source"] for r in resumed}
    return max(r["t"] for r in resumed) - crashed, "/".join(sorted(sources))


def bench_crash(mib: int, repeats: int, work: Path) -> list[list[str]]:
    rows = []
    for mode in ("ram", "disk"):
        times, source = [], ""
        for _ in range(repeats):
            t, source = _crash_once(mode, mib, work)
            if t is not None:
                times.append(t)
        rows.append([f"resume from {mode}", source, spread(times)])
    return rows


def bench_stall(mib: int, steps: int, work: Path) -> list[list[str]]:
    import torch

    from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig
    from stalwart.launch.snapshots import SnapshotMemory

    torch.manual_seed(0)
    # Adam keeps two moments per parameter: parameters are a third of the state.
    width = int(((mib << 20) / 3 / 4 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(32, width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    state_mib = (
        sum(
            t.numel() * t.element_size()
            for t in [*model.state_dict().values()]
            + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        )
        / 2**20
    )
    mem = SnapshotMemory(1, int(state_mib * 1.2) << 20)
    os.environ.update(mem.worker_env())
    os.environ["LOCAL_RANK"] = "0"
    plain: list[float] = []
    with_save: list[float] = []
    stalls: list[float] = []
    try:
        with AsyncCheckpointer(
            work / "stall", rank=0, world_size=1, config=CheckpointerConfig(persist_every=10**6)
        ) as ck:
            for _ in range(3):  # warm: first copies fault the mapping in
                ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, 0)
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                plain.append(time.perf_counter() - t0)
            for i in range(steps):
                t0 = time.perf_counter()
                step()
                ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, i + 1)
                with_save.append(time.perf_counter() - t0)
                stalls.append(ck.last_stall_s)
    finally:
        mem.close()
    share = (med(stalls) or 0) / (med(plain) or 1) * 100
    return [
        [
            f"{state_mib:.0f} MiB (model + Adam)",
            fmt(med(plain), "s", 4),
            fmt(med(stalls), "s", 4),
            f"{share:.1f} %",
            fmt(med(with_save), "s", 4),
        ],
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512, help="state per rank")
    ap.add_argument("--stall-mib", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-crash", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    print(f"machine: {machine()}; load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/tmp")) as tmp:
        work = Path(tmp)
        show(
            f"restore {a.size_mib} MiB (one rank's share), min / median / max of {a.repeats}",
            ["from", "time", "per GiB"],
            bench_restore(a.size_mib, a.repeats, work),
            a.markdown,
        )
        if not a.skip_crash:
            show(
                f"crash -> first resumed step, 2 ranks x {a.size_mib} MiB, warm restart",
                ["mode", "restored from", "time"],
                bench_crash(a.size_mib, a.repeats, work),
                a.markdown,
            )
        show(
            f"save stall at every step ({a.steps} steps, RAM only)",
            ["state", "step (no save)", "stall per save", "stall / step", "step + save"],
            bench_stall(a.stall_mib, a.steps, work),
            a.markdown,
        )


if __name__ == "__main__":
    main()
