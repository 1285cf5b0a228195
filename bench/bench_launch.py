"""Launcher benchmark: cold launch -> first step, crash -> first resumed step.

The same job (examples/train_ddp.py, 2 ranks on gloo, async checkpoint every 20 steps,
rank 1 exits at step 30 of the first attempt) runs under torchrun as-is, torchrun with
its working configuration here (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), stalwart with
cold workers and stalwart with warm workers (the default), interleaved, several times.  Times come from the workers' own per-step timestamps
(rank 0 writes one JSON line per step), so every launcher is measured the same way:

* cold launch: from just before the launcher is started to the end of step 0;
* crash -> resumed: from the end of the last step before the crash to the end of the
  first step of the next attempt;
* success: the job finished (exit 0, every step done) within the per-run deadline.

    python bench/bench_launch.py [--repeats 5] [--markdown]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import fmt, machine, med, ratio, run_job, show, spread

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
STEPS, CRASH_AT, CKPT_EVERY = 40, 30, 20
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STALWART = [sys.executable, "-m", "stalwart.cli", "run"]


@dataclass
class Variant:
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cold: list[float] = field(default_factory=list)
    resume: list[float] = field(default_factory=list)
    ok: int = 0
    runs: int = 0


def variants() -> list[Variant]:
    common = ["--nproc-per-node", "2", "--max-restarts", "1"]
    return [
        Variant("torchrun (as-is)", [*TORCHRUN, "--standalone", *common]),
        Variant(
            "torchrun + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            [*TORCHRUN, "--standalone", *common],
            {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        ),
        Variant("stalwart run --no-warm (cold)", [*STALWART, "--no-warm", *common]),
        Variant("stalwart run (warm, default)", [*STALWART, *common]),
    ]


def run_once(v: Variant, work: Path, deadline: float) -> None:
    args = [
        *v.cmd,
        "--log-dir",
        str(work / "logs"),
        str(EXAMPLE),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(work / "p.jsonl"),
        "--quiet",
    ]
    t0 = time.time()
    inject = {"STALWART_INJECT": f"exit:rank=1,step={CRASH_AT},code=1"}
    code, recs = run_job(args, {**v.env, **inject}, work, deadline)
    v.runs += 1
    first = [r for r in recs if r["attempt"] == 0]
    if first:
        v.cold.append(first[0]["time"] - t0)
    before = [r for r in recs if r["attempt"] == 0 and r["step"] == CRASH_AT - 1]
    after = [r for r in recs if r["attempt"] == 1]
    if before and after:
        v.resume.append(after[0]["time"] - before[0]["time"])
    if code == 0 and any(r["step"] == STEPS - 1 for r in after):
        v.ok += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=90.0, help="seconds per run")
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    vs = variants()
    for i in range(ns.repeats):
        for v in vs:  # interleaved, so drift on a shared machine hits every variant alike
            with tempfile.TemporaryDirectory(prefix="bench_launch_") as d:
                run_once(v, Path(d), ns.deadline)
            print(f"[{i + 1}/{ns.repeats}] {v.name}: ok {v.ok}/{v.runs}", file=sys.stderr)
    ref = vs[1]
    rows = []
    for v in vs:
        rows.append(
            [
                v.name,
                f"{v.ok}/{v.runs}",
                spread(v.cold),
                spread(v.resume),
                ratio(med(v.cold), med(ref.cold)),
                ratio(med(v.resume), med(ref.resume)),
            ]
        )
    print(f"machine: {machine()}")
    show(
        "Launcher: 2-rank DDP on gloo, rank 1 exits at step 30 (min / median / max)",
        [
            "launcher",
            "restart success",
            "cold launch -> step 0",
            "crash -> resumed step",
            "cold vs working torchrun",
            "resume vs working torchrun",
        ],
        rows,
        ns.markdown,
    )
    for s in vs[2:]:
        print(f"{s.name}: cold {fmt(med(s.cold))}, crash->resumed {fmt(med(s.resume))}")


if __name__ == "__main__":
    main()
